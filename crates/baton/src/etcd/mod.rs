//! The etcd v3 backend (also serves `baton server`, which speaks the same API subset).
//!
//! Layout: every candidate owns `<prefix>/<election>/@candidates/<lease id>-<n>`, created in a
//! transaction only if absent and bound to the process's lease (`candidates_scope` says why no
//! two elections can share a key). The leader is the key with the lowest create revision, and
//! that revision is the fencing token. A waiter watches only the deletion of the key with the
//! next-lower create revision, so a handoff wakes one waiter.

mod client;
mod endpoints;
mod fence;
mod lease;
mod queue;
mod watch_hub;

use std::collections::BTreeMap;
use std::sync::atomic::Ordering;
use std::sync::Arc;
use std::time::Duration;

use self::client::{
    Client, ConnectOptions, EventType, GetOptions, SortOrder, SortTarget, WatchOptions,
};
use baton_core::ElectionConfig;
use tokio::sync::mpsc;

use self::endpoints::NotReady;
use self::fence::EtcdFencer;
use self::lease::EtcdLeaseTransport;
use self::watch_hub::WatchHub;
use crate::backend::{BoxFuture, Connection};
use crate::clock::Clock;
use crate::driver::{LeasePool, TokenMemory};
use crate::election::{CandidateSpec, Command, LeaderInfo, Leadership, Observed};
use crate::error::{Error, Result};
use crate::fenced::{FencedTxn, FencedTxnResponse};
use crate::lease_driver::{start_lease, LeaseHandle};
use crate::stats::Stats;
use crate::url::CANDIDATES_MARKER;

/// etcd leases are whole seconds; the server raises anything shorter than its own minimum
/// (1.5 × election timeout, 2 s with default settings) and we use whatever it grants.
pub(crate) const MIN_TTL: Duration = Duration::from_secs(1);

/// Bound on every unary request.
pub(crate) const REQUEST_TIMEOUT: Duration = Duration::from_secs(5);

/// Bound on connecting and on the reachability probe.
const CONNECT_TIMEOUT: Duration = Duration::from_secs(3);

/// How long a stream that went silent waits for another member to answer before it takes the
/// next one in the URL's order (see [`client::Client::pinned_elsewhere`]).
pub(crate) const ELSEWHERE_WAIT: Duration = Duration::from_secs(1);

/// How often a member carrying a stream (an observer's watch, the watch hub's) is asked whether
/// it still answers, how long it has to answer, and the bound on opening a stream there.
pub(crate) const MEMBER_PROBE: Duration = Duration::from_secs(1);

use crate::driver::RETRY_PAUSE;

/// etcd's `MaxLeaseTTL`: the server refuses a grant above it ("too large lease TTL"). A TTL
/// above it is bad input, rejected when the election is made rather than at the first grant.
pub(crate) const MAX_TTL: Duration = Duration::from_secs(9_000_000_000);

/// What etcd leases can be: whole seconds, from [`MIN_TTL`] to [`MAX_TTL`].
pub(crate) const LIMITS: baton_core::BackendLimits = baton_core::BackendLimits {
    min_ttl: MIN_TTL,
    max_ttl: MAX_TTL,
    ttl_step: Duration::from_secs(1),
};

fn backend_error(operation: &'static str, error: client::Error) -> Error {
    crate::metrics::backend_error(operation);
    // gRPC's UNAVAILABLE (14) is what a refused or broken connection becomes.
    const UNAVAILABLE: i32 = 14;
    // The channel connects lazily, so a transport failure (refused, reset, timed out) comes
    // back as the status of the request it failed.
    let unreachable = match &error {
        // tonic reports a connection that broke under a request as UNKNOWN "transport error",
        // with the operating system's error down its source chain.
        client::Error::GRpcStatus(status) => {
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
        retryable: retryable(&error),
        source: Some(Box::new(error)),
    }
}

/// Whether the same request may succeed later: etcd's transient answers (overload, a leader
/// election under way, a request cut short) are; refusals of the request itself are not.
fn retryable(error: &client::Error) -> bool {
    // gRPC status codes: CANCELLED 1, UNKNOWN 2, DEADLINE_EXCEEDED 4, RESOURCE_EXHAUSTED 8,
    // ABORTED 10, INTERNAL 13, UNAVAILABLE 14 are transient; INVALID_ARGUMENT, NOT_FOUND,
    // PERMISSION_DENIED, FAILED_PRECONDITION, UNAUTHENTICATED and the rest are not.
    const TRANSIENT: [i32; 7] = [1, 2, 4, 8, 10, 13, 14];
    match error {
        client::Error::GRpcStatus(status) => TRANSIENT.contains(&(status.code() as i32)),
        client::Error::InvalidArgs(_) | client::Error::InvalidUri(_) => false,
        client::Error::Watch(_) | client::Error::LeaseKeepAlive(_) => true,
    }
}

/// Runs one request under [`REQUEST_TIMEOUT`], counting it.
async fn request<T>(
    stats: &Stats,
    operation: &'static str,
    call: impl std::future::Future<Output = std::result::Result<T, client::Error>>,
) -> Result<T> {
    request_within(REQUEST_TIMEOUT, stats, operation, call).await
}

/// Runs one request under `limit`, counting it.
async fn request_within<T>(
    limit: Duration,
    stats: &Stats,
    operation: &'static str,
    call: impl std::future::Future<Output = std::result::Result<T, client::Error>>,
) -> Result<T> {
    stats.request();
    timed(limit, operation, call).await
}

/// How long a request that may be sent twice waits for its answer before [`hedged`] sends it
/// again elsewhere. A healthy member answers a write in milliseconds (one fsync).
const HEDGE_AFTER: Duration = Duration::from_millis(300);

/// Runs `make(client)` under `limit`, counting it, like [`request_within`]; with several
/// endpoints, if no answer came within [`HEDGE_AFTER`], also `make` on a client pinned to the
/// member that answers a read first. The balanced channel may have sent the first to a member
/// that hangs (accepts, never answers), which it keeps using until a check has waited 2 s for
/// it: a resign lost that way left the successor waiting out the TTL. The first success wins;
/// a failure waits for the other's answer. Only for a request that does nothing more when
/// applied twice: a delete guarded by our key's create revision or lease, a revoke.
async fn hedged<T, Fut>(
    client: &Client,
    limit: Duration,
    stats: &Stats,
    operation: &'static str,
    make: impl Fn(Client) -> Fut,
) -> Result<T>
where
    Fut: std::future::Future<Output = std::result::Result<T, client::Error>>,
{
    stats.request();
    let call = async {
        let first = make(client.clone());
        tokio::pin!(first);
        tokio::select! {
            answer = &mut first => return answer,
            () = tokio::time::sleep(HEDGE_AFTER) => {}
        }
        let second = async {
            let Some(other) = client.fastest(limit).await else {
                return Err(client::Error::GRpcStatus(tonic::Status::unavailable(
                    "no other endpoint answered",
                )));
            };
            stats.request();
            make(other).await
        };
        tokio::pin!(second);
        tokio::select! {
            answer = &mut first => match answer {
                Ok(value) => Ok(value),
                Err(error) => second.await.map_err(|_| error),
            },
            answer = &mut second => match answer {
                Ok(value) => Ok(value),
                Err(_) => first.await,
            },
        }
    };
    timed(limit, operation, call).await
}

/// [`hedged`] for one transaction (one that does nothing more when applied twice).
async fn hedged_txn(
    client: &Client,
    limit: Duration,
    stats: &Stats,
    operation: &'static str,
    txn: client::Txn,
) -> Result<client::TxnResponse> {
    hedged(client, limit, stats, operation, |mut client| {
        let txn = txn.clone();
        async move { client.txn(txn).await }
    })
    .await
}

/// Runs one request under `limit`, mapping its failure and its timeout to [`Error`].
async fn timed<T>(
    limit: Duration,
    operation: &'static str,
    call: impl std::future::Future<Output = std::result::Result<T, client::Error>>,
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

/// One granted lease, shared by every candidate with the same settings.
#[derive(Debug)]
pub(crate) struct EtcdLease {
    id: i64,
    handle: LeaseHandle,
}

pub(crate) struct EtcdBackend {
    client: Client,
    prefix: String,
    clock: Clock,
    leases: LeasePool<EtcdLease>,
    /// The highest token seen elected per election, across this backend's candidacies: a new
    /// entry at or below it means etcd's revision went backwards (restored or wiped). One
    /// number per election this process has led.
    tokens: TokenMemory,
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
        let mut client = Client::connect(&endpoints, Some(options))
            .map_err(|error| unreachable(error.to_string()))?;
        // Several endpoints: each is asked once which cluster it serves, so that a URL that
        // mixes clusters is refused before any candidate acts on it, and a member that is down
        // is left out rather than tried.
        match client.ready(CONNECT_TIMEOUT).await {
            Ok(()) => {}
            Err(NotReady::Unreachable(detail)) => return Err(unreachable(detail)),
            Err(NotReady::ClustersDiffer(which)) => {
                return Err(Error::InvalidUrl {
                    url: format!("etcd://{joined}{prefix}"),
                    reason: format!(
                        "its endpoints answer for different clusters ({which}): list the members of one cluster"
                    ),
                })
            }
        }
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
            leases: LeasePool::default(),
            tokens: TokenMemory::default(),
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
        self.leases
            .get(config, async {
                let (id_tx, id_rx) = tokio::sync::oneshot::channel();
                let transport = EtcdLeaseTransport {
                    client: self.client.clone(),
                    id: 0,
                    stream: None,
                    tried: None,
                    avoid: None,
                    stats: self.stats.clone(),
                    on_grant: Some(id_tx),
                    gone: false,
                    opened: None,
                };
                let handle = start_lease(transport, config.clone(), self.clock.clone()).await?;
                let id = id_rx.await.map_err(|_| Error::Closed)?;
                Ok(EtcdLease { id, handle })
            })
            .await
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
        if self.leases.is_closed() {
            return Err(Error::Closed);
        }
        let prefix = self.candidates_scope(&election);
        // A backend we cannot reach right now is not bad input: the stream starts with
        // `Unavailable` and follows once the backend answers (a refused request still fails).
        let first = match self.snapshot(&prefix).await {
            Ok(snapshot) => Ok(snapshot),
            Err(error) if error.is_retryable() => Err(error),
            Err(error) => return Err(error),
        };
        let backend = self.clone();
        tokio::spawn(async move {
            let mut last: Option<Option<LeaderInfo>> = None;
            let mut outage = first.as_ref().err().map(ToString::to_string);
            let (mut members, mut revision) = first.unwrap_or_default();
            // The endpoint the last watch was on: after an outage the next goes elsewhere.
            let mut tried = None;
            loop {
                if let Some(reason) = outage.take() {
                    // Connection trouble, a server that stopped answering, or compaction: say
                    // so (what we showed may be stale now), then resynchronise from a fresh
                    // snapshot (level-triggered: the current state is what matters).
                    tracing::warn!(%election, %reason, "observer cannot see the backend; resynchronising");
                    if tx.send(Observed::Unavailable { reason }).await.is_err() {
                        return;
                    }
                    // After an outage the current leader is always reported again.
                    last = None;
                    loop {
                        tokio::time::sleep(RETRY_PAUSE).await;
                        if tx.is_closed() || backend.leases.is_closed() {
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
                let current = leader_of(&members);
                if last.as_ref() != Some(&current) {
                    if tx.send(Observed::Leader(current.clone())).await.is_err() {
                        return;
                    }
                    last = Some(current);
                }
                match backend
                    .follow(
                        &prefix,
                        &mut members,
                        &mut revision,
                        &mut last,
                        &tx,
                        &mut tried,
                    )
                    .await
                {
                    Ok(()) => return,
                    Err(error) => outage = Some(error.to_string()),
                }
            }
        });
        Ok(())
    }

    /// All candidates of an election, by create revision, and the revision of the read.
    ///
    /// Sent again elsewhere if unanswered for [`HEDGE_AFTER`] (a read is safe twice): after an
    /// outage the observer resynchronises with it, and the balanced channel may still send it
    /// to the member that just hung, which would cost the whole request timeout, 5 s with
    /// nothing to show.
    async fn snapshot(&self, prefix: &str) -> Result<(BTreeMap<i64, String>, i64)> {
        let response = hedged(
            &self.client,
            REQUEST_TIMEOUT,
            &self.stats,
            "get candidates",
            |mut client| {
                let prefix = prefix.to_string();
                async move {
                    client
                        .get(prefix, Some(GetOptions::new().with_prefix()))
                        .await
                }
            },
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
    ///
    /// With several endpoints the watch and its probes go to one endpoint (another than
    /// `tried`, the one of the last watch, if another answers), and the watch counts as broken
    /// once that endpoint stops answering its checks: probes through the balanced channel
    /// could be answered by another member while this one hangs and the watch says nothing.
    async fn follow(
        &self,
        prefix: &str,
        members: &mut BTreeMap<i64, String>,
        revision: &mut i64,
        last: &mut Option<Option<LeaderInfo>>,
        tx: &mpsc::Sender<Observed>,
        tried: &mut Option<usize>,
    ) -> Result<()> {
        let (mut client, endpoint) = self.client.pinned_elsewhere(*tried, ELSEWHERE_WAIT).await;
        *tried = endpoint.map(|pin| pin.index);
        let options = WatchOptions::new()
            .with_prefix()
            .with_prev_key()
            .with_start_revision(*revision + 1);
        // Bounded as a probe is: a member that hangs just as the watch opens would otherwise
        // keep the observer silent for the whole request timeout.
        let mut stream = request_within(
            MEMBER_PROBE,
            &self.stats,
            "watch",
            client.watch(prefix, Some(options)),
        )
        .await?;
        // A watch says nothing while the server is silent (stopped, partitioned): probe it, so
        // that "no news" is never mistaken for "no change" for long.
        let mut closing = std::pin::pin!(self.leases.closing());
        let mut probe = tokio::time::interval(MEMBER_PROBE);
        probe.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
        probe.tick().await;
        loop {
            let message = tokio::select! {
                message = stream.message() => message,
                _ = tx.closed() => return Ok(()),
                // The stream ends with its backend (the task's end drops the sender).
                _ = closing.as_mut() => return Ok(()),
                name = client.left(endpoint) => return Err(Error::Unreachable {
                    backend: "etcd",
                    endpoints: name,
                    detail: "the endpoint carrying the watch stopped answering".to_string(),
                }),
                _ = probe.tick() => {
                    let options = GetOptions::new().with_prefix().with_count_only();
                    request_within(
                        MEMBER_PROBE,
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
        // The leader's key, not merely a key with this create revision: a waiter's entry
        // revision (shown by `participants`) must not pass the fence. The key with the lowest
        // create revision leads, and while it exists no lower one can appear, so checking that
        // it still exists with `token` (the fence below) checks that `token` still leads.
        let mut client = self.client.clone();
        let options = GetOptions::new()
            .with_prefix()
            .with_keys_only()
            .with_sort(SortTarget::Create, SortOrder::Ascend)
            .with_limit(1);
        let response = request_within(
            limit,
            &self.stats,
            "find leader key",
            client.get(self.candidates_scope(election), Some(options)),
        )
        .await?;
        let Some(kv) = response
            .kvs()
            .first()
            .filter(|kv| u64::try_from(kv.create_revision()) == Ok(token))
        else {
            return Err(fenced());
        };
        let fence = EtcdFencer {
            client: self.client.clone(),
            leader_key: kv.key().to_vec(),
        };
        fence.fenced(election, token, txn, limit).await
    }
}

fn leader_of(members: &BTreeMap<i64, String>) -> Option<LeaderInfo> {
    members
        .iter()
        .next()
        .map(|(revision, raw)| describe(*revision, raw.as_bytes()))
}

/// The candidate an entry with this create revision and value describes.
fn describe(revision: i64, raw: &[u8]) -> LeaderInfo {
    LeaderInfo::from_entry(u64::try_from(revision).unwrap_or(0), raw)
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
pub(super) fn root_cause(error: &client::Error) -> String {
    let mut source: Option<&dyn std::error::Error> = match error {
        client::Error::GRpcStatus(status) => Some(status),
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

impl Connection for EtcdBackend {
    fn limits(&self) -> baton_core::BackendLimits {
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
        Box::pin(EtcdBackend::leader(self, election))
    }

    fn participants<'a>(&'a self, election: &'a str) -> BoxFuture<'a, Result<Vec<LeaderInfo>>> {
        Box::pin(EtcdBackend::participants(self, election))
    }

    fn spawn_observer(
        self: Arc<Self>,
        election: String,
        tx: mpsc::Sender<Observed>,
    ) -> BoxFuture<'static, Result<()>> {
        Box::pin(async move { EtcdBackend::spawn_observer(&self, election, tx).await })
    }

    fn fenced_txn<'a>(
        &'a self,
        election: &'a str,
        token: u64,
        txn: &'a FencedTxn,
        limit: Duration,
    ) -> BoxFuture<'a, Result<FencedTxnResponse>> {
        Box::pin(self.fenced_txn_by_token(election, token, txn, limit))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Each backend classifies its errors: transient answers are retryable, refusals of the
    /// request are not, a broken connection is `Unreachable`; the client's error stays the
    /// source.
    #[test]
    fn errors_are_classified_and_keep_their_source() {
        let status = |code| client::Error::GRpcStatus(tonic::Status::new(code, "x"));
        let error = backend_error("put", status(tonic::Code::PermissionDenied));
        assert!(!error.is_retryable(), "{error:?}");
        assert!(std::error::Error::source(&error).is_some());
        let error = backend_error("put", status(tonic::Code::InvalidArgument));
        assert!(!error.is_retryable(), "{error:?}");
        let error = backend_error("put", status(tonic::Code::ResourceExhausted));
        assert!(error.is_retryable(), "{error:?}");
        let error = backend_error("put", status(tonic::Code::Unavailable));
        assert!(matches!(error, Error::Unreachable { .. }), "{error:?}");
        assert!(error.is_retryable());
    }

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

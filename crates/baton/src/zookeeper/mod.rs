//! The ZooKeeper backend, `zk://host:port[,host:port]/chroot` (also `zookeeper://`).
//!
//! Layout under the chroot (persistent nodes, created by the first write that needs them; reads
//! never create anything, and a missing chroot reads as elections with no candidate):
//!
//! - `<chroot>/<election>/@candidates/<session id hex>-<n>-<sequence>`: one ephemeral sequential
//!   znode per candidate, owned by the ZooKeeper session of its lease, holding the candidate's id
//!   (then a newline and the leader value, if any). The part before the sequence number (the
//!   *stem*) names one candidacy under one session, so a create whose answer was lost is found
//!   and adopted instead of duplicated (what Curator calls "protected" mode).
//! - `<chroot>/<election>/@ids/<id>`: one ephemeral znode per live candidate id, created in one
//!   `multi` with the entry and holding the entry's stem, so two live candidates with one id are
//!   refused.
//!
//! Queue order is the sequence number. An entry's position (its fencing token when it leads)
//! is its czxid, the transaction id that created it: strictly increasing across the ensemble,
//! and ordered like the sequence numbers within one parent. The leader is the entry with the
//! lowest sequence number; a waiter watches only the one just ahead of it.
//!
//! A lease is a ZooKeeper session of its own (`lease.rs`). Everything else (queue reads,
//! watches, observers, fencing) goes through one main session per `Backend`, established again
//! if it expires. Fenced data keys are znodes under the chroot (`fence.rs`).

mod fence;
mod lease;
mod queue;
mod watch;

use std::future::Future;
use std::sync::atomic::Ordering;
use std::sync::{Arc, Mutex};
use std::time::Duration;

use baton_core::{BackendLimits, ElectionConfig};
use tokio::sync::mpsc;
use zookeeper_client as zk;

use self::lease::{ZkLease, ZkLeaseTransport};
use crate::backend::{BoxFuture, Connection};
use crate::clock::Clock;
use crate::driver::{LeasePool, TokenMemory, RETRY_PAUSE};
use crate::election::{CandidateSpec, Command, LeaderInfo, Leadership, Observed};
use crate::error::{Error, Result};
use crate::fenced::{FencedTxn, FencedTxnResponse};
use crate::lease_driver::start_lease;
use crate::stats::Stats;
use crate::url::{CANDIDATES_MARKER, IDS_MARKER};

/// The backend's name in errors.
const BACKEND: &str = "zookeeper";

/// Bound on every request.
pub(crate) const REQUEST_TIMEOUT: Duration = Duration::from_secs(5);

/// Bound on establishing a session.
const CONNECT_TIMEOUT: Duration = Duration::from_secs(5);

/// Bound on deleting our own entry: resigning must not hang on an unreachable ensemble (the
/// entry goes with the session anyway).
const DELETE_TIMEOUT: Duration = Duration::from_secs(2);

/// Bound on an observer's requests, so that an ensemble that stopped answering shows soon.
const OBSERVER_REQUEST: Duration = Duration::from_secs(1);

/// The main session asks for the longest session timeout there is; the server lowers it to its
/// `maxSessionTimeout`, which is then the longest TTL a lease can have.
const MAIN_SESSION_ASK: Duration = Duration::from_millis(i32::MAX as u64);

/// A connection of the main session that is silent this long is deemed lost (the client pings
/// at 3/8 of it), so an outage shows within it.
const MAIN_CONNECTION_TIMEOUT: Duration = Duration::from_secs(2);

/// The probe session at connect asks for this; the server raises it to its
/// `minSessionTimeout`, which is then the shortest TTL a lease can have. (Shorter asks would
/// leave the client too little time to establish the session.)
const PROBE_SESSION_ASK: Duration = Duration::from_secs(1);

/// How often a read that raced with a change is tried again before giving up (retryably).
const RACE_RETRIES: usize = 64;

/// Options of the persistent nodes baton creates (the chroot, elections, their folders).
const PERSISTENT: zk::CreateOptions<'static> =
    zk::CreateMode::Persistent.with_acls(zk::Acls::anyone_all());

/// Maps a ZooKeeper error to baton's: connection trouble is `Unreachable` (in one line), the
/// rest a backend error, retryable when the same request may succeed later.
pub(crate) fn zk_error(operation: &'static str, error: zk::Error) -> Error {
    crate::metrics::backend_error(operation);
    match error {
        zk::Error::ConnectionLoss | zk::Error::NoHosts | zk::Error::Timeout => Error::Unreachable {
            backend: BACKEND,
            endpoints: String::new(),
            detail: format!("{error} (during {operation})"),
        },
        error => Error::Backend {
            backend: BACKEND,
            operation,
            detail: error.to_string(),
            retryable: retryable(&error),
            source: Some(Box::new(error)),
        },
    }
}

/// Whether the same request may succeed later: a session that expired or moved is established
/// again, an overloaded server recovers; a refusal of the request itself does not change.
fn retryable(error: &zk::Error) -> bool {
    !matches!(
        error,
        zk::Error::NoNode
            | zk::Error::NoAuth
            | zk::Error::BadVersion
            | zk::Error::NoChildrenForEphemerals
            | zk::Error::NodeExists
            | zk::Error::NotEmpty
            | zk::Error::InvalidAcl
            | zk::Error::AuthFailed
            | zk::Error::BadArguments(_)
            | zk::Error::QuotaExceeded
            | zk::Error::MarshallingError
            | zk::Error::Unimplemented
            | zk::Error::NotReadOnly
            | zk::Error::ReconfigDisabled
            | zk::Error::UnexpectedErrorCode(_)
            | zk::Error::UnmarshalError { .. }
    )
}

/// A protocol error: what ZooKeeper answered breaks what baton relies on.
fn protocol(operation: &'static str, detail: &str) -> Error {
    crate::metrics::backend_error(operation);
    Error::protocol(BACKEND, operation, detail)
}

/// An answer that raced with changes too often: retryable.
fn kept_changing(operation: &'static str, detail: &str) -> Error {
    crate::metrics::backend_error(operation);
    Error::Backend {
        backend: BACKEND,
        operation,
        detail: detail.to_string(),
        retryable: true,
        source: None,
    }
}

/// Runs one request under `limit`, counting it. The outer error is the timeout; the inner one
/// is ZooKeeper's answer, for the caller to tell apart.
async fn ask<T>(
    stats: &Stats,
    limit: Duration,
    operation: &'static str,
    call: impl Future<Output = std::result::Result<T, zk::Error>>,
) -> Result<std::result::Result<T, zk::Error>> {
    stats.request();
    bounded(limit, operation, call).await
}

/// Runs `call` under `limit`; a timeout is [`Error::Timeout`].
async fn bounded<T>(
    limit: Duration,
    operation: &'static str,
    call: impl Future<Output = T>,
) -> Result<T> {
    match tokio::time::timeout(limit, call).await {
        Ok(answer) => Ok(answer),
        Err(_) => {
            crate::metrics::backend_error(operation);
            Err(Error::Timeout {
                operation,
                after_ms: limit.as_millis() as u64,
            })
        }
    }
}

/// Runs one request under [`REQUEST_TIMEOUT`], counting it, every error mapped.
async fn request<T>(
    stats: &Stats,
    operation: &'static str,
    call: impl Future<Output = std::result::Result<T, zk::Error>>,
) -> Result<T> {
    ask(stats, REQUEST_TIMEOUT, operation, call)
        .await?
        .map_err(|error| zk_error(operation, error))
}

/// The main session of a backend: everything but leases goes through it. It is replaced by a
/// new session when it ends (it expired during an outage, say), and when it has been
/// disconnected for a while but a new session can be established: a server whose history went
/// backwards (restored, or wiped) refuses to take an old session back until the client gives
/// up on it, a session timeout later.
pub(crate) struct MainSession {
    hosts: String,
    main: tokio::sync::Mutex<Main>,
    stats: Arc<Stats>,
}

struct Main {
    client: zk::Client,
    /// Since when (as far as a caller has seen) the session has been disconnected.
    disconnected_since: Option<tokio::time::Instant>,
    /// When a new session was last tried.
    last_attempt: Option<tokio::time::Instant>,
}

impl MainSession {
    fn new(hosts: String, client: zk::Client, stats: Arc<Stats>) -> MainSession {
        MainSession {
            hosts,
            main: tokio::sync::Mutex::new(Main {
                client,
                disconnected_since: None,
                last_attempt: None,
            }),
            stats,
        }
    }

    async fn connect(hosts: &str) -> std::result::Result<zk::Client, zk::Error> {
        zk::Client::connector()
            .with_session_timeout(MAIN_SESSION_ASK)
            .with_connection_timeout(MAIN_CONNECTION_TIMEOUT)
            .with_fail_eagerly()
            .connect(hosts)
            .await
    }

    /// The main session's client; a new session if it has ended, or has been disconnected
    /// for longer than [`MAIN_CONNECTION_TIMEOUT`] (tried at most once a second; meanwhile
    /// the ensemble is `Unreachable`).
    pub(crate) async fn client(&self) -> Result<zk::Client> {
        let mut main = self.main.lock().await;
        match main.client.state() {
            zk::SessionState::SyncConnected | zk::SessionState::ConnectedReadOnly => {
                main.disconnected_since = None;
                return Ok(main.client.clone());
            }
            zk::SessionState::Disconnected => {
                let now = tokio::time::Instant::now();
                let since = *main.disconnected_since.get_or_insert(now);
                if now - since < MAIN_CONNECTION_TIMEOUT {
                    // Requests wait for the client to reconnect (each has its timeout).
                    return Ok(main.client.clone());
                }
            }
            // Ended: expired, closed, refused.
            _ => {}
        }
        if main
            .last_attempt
            .is_some_and(|at| at.elapsed() < Duration::from_secs(1))
        {
            return Err(Error::Unreachable {
                backend: BACKEND,
                endpoints: self.hosts.clone(),
                detail: "disconnected; reconnecting".into(),
            });
        }
        main.last_attempt = Some(tokio::time::Instant::now());
        self.stats.request();
        let fresh = bounded(CONNECT_TIMEOUT, "connect", Self::connect(&self.hosts))
            .await?
            .map_err(|error| zk_error("connect", error))?;
        // The old client, dropped, closes its session once it gets through (if ever).
        main.client = fresh;
        main.disconnected_since = None;
        Ok(main.client.clone())
    }
}

/// A connection to a ZooKeeper ensemble.
pub(crate) struct ZkBackend {
    hosts: String,
    chroot: String,
    main: Arc<MainSession>,
    limits: BackendLimits,
    clock: Clock,
    leases: LeasePool<ZkLease>,
    /// The highest token seen elected per election, across this backend's candidacies: a new
    /// entry at or below it means the ensemble's history went backwards (restored or wiped).
    tokens: TokenMemory,
    stats: Arc<Stats>,
    /// On an ensemble of several voting members: its size and half its tick (estimated from
    /// the shortest session, `minSessionTimeout`, by default two ticks). See
    /// [`ZkBackend::margined`].
    ensemble: Option<(usize, Duration)>,
    /// The margins raised so far (said once each).
    raised: Mutex<std::collections::HashSet<(Duration, Duration)>>,
}

impl std::fmt::Debug for ZkBackend {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("ZkBackend")
            .field("hosts", &self.hosts)
            .field("chroot", &self.chroot)
            .finish_non_exhaustive()
    }
}

impl ZkBackend {
    /// Connects: establishes the main session (its negotiated timeout is the longest TTL) and a
    /// short probe session (its negotiated timeout is the shortest).
    pub(crate) async fn connect(endpoints: Vec<String>, chroot: String) -> Result<ZkBackend> {
        let hosts = endpoints.join(",");
        let probe = async {
            zk::Client::connector()
                .with_session_timeout(PROBE_SESSION_ASK)
                .with_fail_eagerly()
                .connect(&hosts)
                .await
        };
        let (main, probe) = tokio::join!(
            tokio::time::timeout(CONNECT_TIMEOUT, MainSession::connect(&hosts)),
            tokio::time::timeout(CONNECT_TIMEOUT, probe),
        );
        let main = established(&endpoints, main).await?;
        // Dropping the probe closes its session.
        let min_ttl = established(&endpoints, probe).await?.session_timeout();
        let limits = BackendLimits {
            min_ttl,
            max_ttl: main.session_timeout().max(min_ttl),
            ttl_step: Duration::from_millis(1),
        };
        let stats = Arc::new(Stats::default());
        // The ensemble's voting members, as the server knows them (3.5 and later; nothing to
        // read, or a standalone server, leaves the margin as it is).
        let members = match tokio::time::timeout(CONNECT_TIMEOUT, main.get_config()).await {
            Ok(Ok((config, _))) => voting_members(&String::from_utf8_lossy(&config)),
            _ => 0,
        };
        let ensemble = (members >= 2).then_some((members, min_ttl / 4));
        // The chroot is not created here: a read (`baton leader`, `observe`) must not write,
        // and a missing chroot reads as elections with no candidate. The first write (a
        // campaign, a fenced write) creates the folders it needs, the chroot with them.
        Ok(ZkBackend {
            main: Arc::new(MainSession::new(hosts.clone(), main, stats.clone())),
            hosts,
            chroot,
            limits,
            clock: Clock::new(),
            leases: LeasePool::default(),
            tokens: TokenMemory::default(),
            stats,
            ensemble,
            raised: Mutex::default(),
        })
    }

    /// `config` with its safety margin raised, on an ensemble, to half a tick plus 0.15 × TTL
    /// (the README's rule 1 limit): a follower reports its clients' activity to the leader only
    /// at its own pings, every half tick, so if it loses the leader just after a renewal, the
    /// leader may expire the session that much (plus the client's ping interval, 3/20 of the
    /// TTL) before the client's deadline. An attack on a 3-member ensemble at the default
    /// 100 ms margin had the old holder's command overlap its successor's by 124-200 ms in 5
    /// of 5 rounds, and none at 600 ms. Said once per setting. A raised margin only stops a
    /// holder whose renewals stall earlier; a margin that would leave the renewals too little
    /// time is left alone, with a warning.
    fn margined(&self, config: &ElectionConfig) -> ElectionConfig {
        let Some((members, half_tick)) = self.ensemble else {
            return config.clone();
        };
        let needed = ensemble_margin(half_tick, config.ttl);
        if config.safety_margin >= needed {
            return config.clone();
        }
        let mut raised = config.clone();
        raised.safety_margin = needed;
        let fits = raised.validate(&self.limits).is_ok();
        let first = self
            .raised
            .lock()
            .unwrap_or_else(|e| e.into_inner())
            .insert((config.ttl, config.safety_margin));
        if first && fits {
            tracing::warn!(
                "a ZooKeeper ensemble of {members} members: the safety margin is raised from {} to \
                 {} for TTL {} (half a tick plus 0.15 x TTL: a follower that loses its leader \
                 just after a renewal lets the session expire that much early)",
                crate::format_duration(config.safety_margin),
                crate::format_duration(needed),
                crate::format_duration(config.ttl),
            );
        } else if first {
            tracing::warn!(
                "a ZooKeeper ensemble of {members} members: the safety margin {} is below {} for \
                 TTL {} (half a tick plus 0.15 x TTL), and raising it would leave the renewals too \
                 little time: a follower that loses its leader just after a renewal can let the \
                 session expire before the holder stops; fence the work, or lengthen the TTL",
                crate::format_duration(config.safety_margin),
                crate::format_duration(needed),
                crate::format_duration(config.ttl),
            );
        }
        if fits {
            raised
        } else {
            config.clone()
        }
    }

    /// `<chroot>/<election>`.
    fn election_path(&self, election: &str) -> String {
        format!("{}/{}", self.chroot, node_name(election))
    }

    /// `<chroot>/<election>/@candidates`: every entry of the election, and nothing else, lies
    /// directly under it. An election name is one segment and never a marker, and the chroot
    /// has no marker segment (both checked on input), so no two elections share it.
    fn candidates_dir(&self, election: &str) -> String {
        format!("{}/{CANDIDATES_MARKER}", self.election_path(election))
    }

    /// `<chroot>/<election>/@ids`.
    fn ids_dir(&self, election: &str) -> String {
        format!("{}/{IDS_MARKER}", self.election_path(election))
    }

    /// A live lease with these settings: a new session if the last one has ended.
    async fn lease(&self, config: &ElectionConfig) -> Result<Arc<ZkLease>> {
        let config = &self.margined(config);
        self.leases
            .get(config, async {
                let (granted_tx, granted) = tokio::sync::oneshot::channel();
                let transport = ZkLeaseTransport::new(
                    self.hosts.clone(),
                    config,
                    self.stats.clone(),
                    granted_tx,
                );
                let handle = start_lease(transport, config.clone(), self.clock.clone()).await?;
                let (session_id, client) = granted.await.map_err(|_| Error::Closed)?;
                Ok(ZkLease {
                    session_id,
                    client,
                    handle,
                })
            })
            .await
    }

    /// The entries of the election in `dir`, in queue order; `None` if it never had one.
    async fn entries(
        &self,
        client: &zk::Client,
        dir: &str,
        limit: Duration,
    ) -> Result<Option<Vec<(u64, String)>>> {
        match ask(
            &self.stats,
            limit,
            "get candidates",
            client.list_children(dir),
        )
        .await?
        {
            Ok(children) => Ok(Some(queue_order(children))),
            Err(zk::Error::NoNode) => Ok(None),
            Err(error) => Err(zk_error("get candidates", error)),
        }
    }

    pub(crate) async fn leader(&self, election: &str) -> Result<Option<LeaderInfo>> {
        let dir = self.candidates_dir(election);
        let client = self.main.client().await?;
        for _ in 0..RACE_RETRIES {
            let entries = self.entries(&client, &dir, REQUEST_TIMEOUT).await?;
            let Some((_, first)) = entries.into_iter().flatten().next() else {
                return Ok(None);
            };
            let path = format!("{dir}/{first}");
            match ask(
                &self.stats,
                REQUEST_TIMEOUT,
                "get leader",
                client.get_data(&path),
            )
            .await?
            {
                Ok((data, stat)) => return Ok(Some(describe(stat.czxid, &data))),
                // Gone since the listing: look again.
                Err(zk::Error::NoNode) => continue,
                Err(error) => return Err(zk_error("get leader", error)),
            }
        }
        Err(kept_changing(
            "get leader",
            "the election's entries keep changing",
        ))
    }

    /// Every candidate of `election` in queue order (the first one leads): the listing, then
    /// every entry's data in one atomic read.
    pub(crate) async fn participants(&self, election: &str) -> Result<Vec<LeaderInfo>> {
        let dir = self.candidates_dir(election);
        let client = self.main.client().await?;
        let Some(entries) = self.entries(&client, &dir, REQUEST_TIMEOUT).await? else {
            return Ok(Vec::new());
        };
        if entries.is_empty() {
            return Ok(Vec::new());
        }
        let mut reader = client.new_multi_reader();
        for (_, name) in &entries {
            reader
                .add_get_data(&format!("{dir}/{name}"))
                .map_err(|error| zk_error("get candidates", error))?;
        }
        let results = request(&self.stats, "get candidates", reader.commit()).await?;
        let mut participants = Vec::with_capacity(results.len());
        for result in results {
            match result {
                zk::MultiReadResult::Data { data, stat } => {
                    participants.push(describe(stat.czxid, &data))
                }
                // Gone since the listing.
                zk::MultiReadResult::Error {
                    err: zk::Error::NoNode,
                } => {}
                zk::MultiReadResult::Error { err } => return Err(zk_error("get candidates", err)),
                _ => return Err(protocol("get candidates", "unexpected answer to a read")),
            }
        }
        Ok(participants)
    }

    /// One look at an election for an observer: its leader, and what tells it of the next
    /// change (a watch on the candidates, or on their folder while there is none) or of a lost
    /// connection.
    async fn look(&self, dir: &str) -> Result<Look> {
        let client = self.main.client().await?;
        let states = client.state_watcher();
        if states.peek_state() != zk::SessionState::SyncConnected {
            return Err(Error::Unreachable {
                backend: BACKEND,
                endpoints: self.hosts.clone(),
                detail: "disconnected; reconnecting".into(),
            });
        }
        for _ in 0..RACE_RETRIES {
            let listed = ask(
                &self.stats,
                OBSERVER_REQUEST,
                "watch candidates",
                client.get_and_watch_children(dir),
            )
            .await?;
            let (children, change) = match listed {
                Ok((children, _, change)) => (children, change),
                Err(zk::Error::NoNode) => {
                    // No candidate ever: wait for the folder to appear.
                    let (stat, change) = ask(
                        &self.stats,
                        OBSERVER_REQUEST,
                        "watch candidates",
                        client.check_and_watch_stat(dir),
                    )
                    .await?
                    .map_err(|error| zk_error("watch candidates", error))?;
                    if stat.is_some() {
                        continue;
                    }
                    return Ok(Look {
                        leader: None,
                        change,
                        states,
                    });
                }
                Err(error) => return Err(zk_error("watch candidates", error)),
            };
            let Some((_, first)) = queue_order(children).into_iter().next() else {
                return Ok(Look {
                    leader: None,
                    change,
                    states,
                });
            };
            let path = format!("{dir}/{first}");
            match ask(
                &self.stats,
                OBSERVER_REQUEST,
                "get leader",
                client.get_data(&path),
            )
            .await?
            {
                Ok((data, stat)) => {
                    return Ok(Look {
                        leader: Some(describe(stat.czxid, &data)),
                        change,
                        states,
                    })
                }
                // Gone since the listing (the watch has seen it): look again.
                Err(zk::Error::NoNode) => continue,
                Err(error) => return Err(zk_error("get leader", error)),
            }
        }
        Err(kept_changing(
            "watch candidates",
            "the election's entries keep changing",
        ))
    }

    pub(crate) async fn spawn_observer(
        self: &Arc<Self>,
        election: String,
        tx: mpsc::Sender<Observed>,
    ) -> Result<()> {
        if self.leases.is_closed() {
            return Err(Error::Closed);
        }
        let dir = self.candidates_dir(&election);
        // An ensemble we cannot reach right now is not bad input: the stream starts with
        // `Unavailable` and follows once it answers (a refused request still fails).
        let first = match self.look(&dir).await {
            Err(error) if !error.is_retryable() => return Err(error),
            first => first,
        };
        let backend = self.clone();
        tokio::spawn(async move {
            let mut closing = std::pin::pin!(backend.leases.closing());
            let mut last: Option<Option<LeaderInfo>> = None;
            let mut next = first;
            loop {
                let look = match next {
                    Ok(look) => look,
                    Err(error) => {
                        // What we showed may be stale now: say so, then look afresh until the
                        // ensemble answers (level-triggered: the current state is what matters).
                        let reason = error.to_string();
                        tracing::warn!(%election, %reason, "observer cannot see the backend; resynchronising");
                        if tx.send(Observed::Unavailable { reason }).await.is_err() {
                            return;
                        }
                        // After an outage the current leader is always reported again.
                        last = None;
                        loop {
                            tokio::select! {
                                _ = tokio::time::sleep(RETRY_PAUSE) => {}
                                _ = tx.closed() => return,
                                _ = closing.as_mut() => return,
                            }
                            if let Ok(look) = backend.look(&dir).await {
                                tracing::warn!(%election, "observer resynchronised");
                                break look;
                            }
                        }
                    }
                };
                let Look {
                    leader,
                    change,
                    mut states,
                } = look;
                if last.as_ref() != Some(&leader) {
                    if tx.send(Observed::Leader(leader.clone())).await.is_err() {
                        return;
                    }
                    last = Some(leader);
                }
                let woke = tokio::select! {
                    event = change.changed() => {
                        backend.stats.watch_events.fetch_add(1, Ordering::Relaxed);
                        if event.event_type == zk::EventType::Session {
                            Err(Error::Unreachable {
                                backend: BACKEND,
                                endpoints: backend.hosts.clone(),
                                detail: format!("session {}", event.session_state),
                            })
                        } else {
                            Ok(())
                        }
                    }
                    state = disconnected(&mut states) => Err(Error::Unreachable {
                        backend: BACKEND,
                        endpoints: backend.hosts.clone(),
                        detail: format!("connection {state}"),
                    }),
                    _ = tx.closed() => return,
                    // The stream ends with its backend (the task's end drops the sender).
                    _ = closing.as_mut() => return,
                };
                next = match woke {
                    Ok(()) => backend.look(&dir).await,
                    Err(error) => Err(error),
                };
            }
        });
        Ok(())
    }

    /// Runs `txn` only while `token` leads `election`: the leader is the entry with the lowest
    /// sequence number, and its czxid must be `token` (a waiter's position is refused).
    pub(crate) async fn fenced_txn_by_token(
        &self,
        election: &str,
        token: u64,
        txn: &FencedTxn,
        limit: Duration,
    ) -> Result<FencedTxnResponse> {
        txn.validate()?;
        fence::validate_keys(txn)?;
        let fenced = || Error::Fenced {
            election: election.to_string(),
            token,
        };
        let started = tokio::time::Instant::now();
        let left = || limit.saturating_sub(started.elapsed());
        let dir = self.candidates_dir(election);
        let client = bounded(limit, "find leader entry", self.main.client()).await??;
        let entries = self.entries(&client, &dir, left()).await?;
        let Some((_, first)) = entries.into_iter().flatten().next() else {
            return Err(fenced());
        };
        // While that entry exists no lower one can appear, so checking that it still exists
        // with czxid `token` (inside the fenced transaction) checks that `token` still leads.
        let fencer = fence::ZkFencer {
            main: self.main.clone(),
            stats: self.stats.clone(),
            chroot: self.chroot.clone(),
            leader: format!("{dir}/{first}"),
        };
        fencer.fenced(election, token, txn, left()).await
    }
}

/// What an observer waits on after one look.
struct Look {
    leader: Option<LeaderInfo>,
    change: zk::OneshotWatcher,
    states: zk::StateWatcher,
}

/// Resolves with the new state once the session is no longer connected.
async fn disconnected(states: &mut zk::StateWatcher) -> zk::SessionState {
    loop {
        let state = states.peek_state();
        if state != zk::SessionState::SyncConnected {
            return state;
        }
        states.changed().await;
    }
}

/// A session established within the connect bound, or an `Unreachable` error in one line.
async fn established(
    endpoints: &[String],
    attempt: std::result::Result<
        std::result::Result<zk::Client, zk::Error>,
        tokio::time::error::Elapsed,
    >,
) -> Result<zk::Client> {
    let detail = match attempt {
        Ok(Ok(client)) => return Ok(client),
        Ok(Err(zk::Error::NoHosts | zk::Error::ConnectionLoss)) => {
            // The client only says no server answered: the operating system says why.
            match refusal(endpoints).await {
                Some(reason) => format!("no server answered ({reason})"),
                None => "no server established a session".to_string(),
            }
        }
        Ok(Err(error)) => error.to_string(),
        Err(_) => format!(
            "no session established within {}",
            baton_core::format_duration(CONNECT_TIMEOUT)
        ),
    };
    Err(Error::Unreachable {
        backend: BACKEND,
        endpoints: endpoints.join(","),
        detail,
    })
}

/// Why a TCP connection to the first endpoint fails ("Connection refused"), if it does.
async fn refusal(endpoints: &[String]) -> Option<String> {
    let first = endpoints.first()?;
    let address = first
        .strip_prefix('[')
        .map_or(first.clone(), |rest| rest.replacen(']', "", 1));
    let connect = tokio::net::TcpStream::connect(address);
    match tokio::time::timeout(Duration::from_secs(1), connect).await {
        Ok(Ok(_)) => None,
        Ok(Err(error)) => Some(format!("{first}: {}", error.kind())),
        Err(_) => Some(format!("{first}: connection timed out")),
    }
}

/// `mkdir -p path` (persistent nodes). A refusal names the path: under a chroot baton may not
/// create (an ACL, an ephemeral znode above it) the step alone would not say where.
async fn mkdir_or_exists(
    stats: &Stats,
    within: Duration,
    operation: &'static str,
    client: &zk::Client,
    path: &str,
) -> Result<()> {
    let Err(error) = ask(stats, within, operation, client.mkdir(path, &PERSISTENT)).await? else {
        return Ok(());
    };
    let mut error = zk_error(operation, error);
    if let Error::Backend { detail, .. } = &mut error {
        *detail = format!("cannot create {path} (or a znode above it): {detail}");
    }
    Err(error)
}

/// A znode name for an election name or candidate id: `/` and `%`, and characters ZooKeeper
/// does not allow in a path, are percent-encoded (as their UTF-8 bytes), and so are the dots of
/// `.` and `..`. Injective, so two names never share a node.
fn node_name(text: &str) -> String {
    if text == "." || text == ".." {
        return text.replace('.', "%2E");
    }
    let mut name = String::with_capacity(text.len());
    for c in text.chars() {
        if c == '/' || c == '%' || crate::url::zookeeper_refuses(c) {
            for byte in c.encode_utf8(&mut [0; 4]).bytes() {
                name.push_str(&format!("%{byte:02X}"));
            }
        } else {
            name.push(c);
        }
    }
    name
}

/// The sequence number ZooKeeper appended to an entry's name (after its stem's last `-`).
fn sequence(name: &str) -> Option<u64> {
    let (_, digits) = name.rsplit_once('-')?;
    if digits.len() < 10 || !digits.bytes().all(|b| b.is_ascii_digit()) {
        return None;
    }
    digits.parse().ok()
}

/// An entry's name without its sequence number.
fn stem(name: &str) -> Option<&str> {
    let (stem, _) = name.rsplit_once('-')?;
    Some(&name[..stem.len() + 1])
}

/// The entries among `children` (names with a sequence number), in queue order.
fn queue_order(children: Vec<String>) -> Vec<(u64, String)> {
    let mut entries: Vec<(u64, String)> = children
        .into_iter()
        .filter_map(|name| Some((sequence(&name)?, name)))
        .collect();
    entries.sort_unstable();
    entries
}

/// An entry's data (see [`crate::election::entry_value`]).
fn encode(id: &str, value: Option<&str>) -> Vec<u8> {
    crate::election::entry_value(id, value).into_bytes()
}

/// The safety margin an ensemble needs at `ttl`: half a tick plus the client's ping interval
/// (3/20 of the TTL).
fn ensemble_margin(half_tick: Duration, ttl: Duration) -> Duration {
    half_tick + ttl.mul_f64(0.15)
}

/// The voting members in the text of `/zookeeper/config` (`server.N=host:port:port[:role][;client]`
/// lines; observers do not vote).
fn voting_members(config: &str) -> usize {
    config
        .lines()
        .filter_map(|line| line.trim().strip_prefix("server."))
        .filter(|line| {
            let spec = line.split(';').next().unwrap_or("");
            !spec.split(':').any(|part| part == "observer")
        })
        .count()
}

/// The candidate an entry with this czxid and data describes.
fn describe(czxid: i64, raw: &[u8]) -> LeaderInfo {
    LeaderInfo::from_entry(u64::try_from(czxid).unwrap_or(0), raw)
}

impl Connection for ZkBackend {
    fn limits(&self) -> BackendLimits {
        self.limits
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
        Box::pin(ZkBackend::leader(self, election))
    }

    fn participants<'a>(&'a self, election: &'a str) -> BoxFuture<'a, Result<Vec<LeaderInfo>>> {
        Box::pin(ZkBackend::participants(self, election))
    }

    fn spawn_observer(
        self: Arc<Self>,
        election: String,
        tx: mpsc::Sender<Observed>,
    ) -> BoxFuture<'static, Result<()>> {
        Box::pin(async move { ZkBackend::spawn_observer(&self, election, tx).await })
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

    #[test]
    fn an_ensemble_counts_its_voting_members_and_needs_the_margin_of_the_rule() {
        let three = "server.1=127.0.0.1:24951:24952:participant;127.0.0.1:24950\n\
                     server.2=127.0.0.1:24954:24955:participant;127.0.0.1:24953\n\
                     server.3=127.0.0.1:24957:24958;127.0.0.1:24956\n\
                     server.4=127.0.0.1:24960:24961:observer;127.0.0.1:24959\n\
                     version=100000000";
        assert_eq!(voting_members(three), 3);
        assert_eq!(voting_members(""), 0);
        assert_eq!(voting_members("version=0"), 0);
        // tickTime 200 ms (half: 100 ms), TTL 3 s: the 550 ms the README's rule asks for.
        let ms = Duration::from_millis;
        assert_eq!(ensemble_margin(ms(100), ms(3_000)), ms(550));
        // The stock tickTime of 2 s at TTL 10 s.
        assert_eq!(ensemble_margin(ms(1_000), ms(10_000)), ms(2_500));
        // At the shortest TTL (two ticks) the margin still leaves the renewals room.
        let config = ElectionConfig::default().with_ttl(ms(400));
        let mut raised = config.clone();
        raised.safety_margin = ensemble_margin(ms(100), config.ttl);
        let limits = BackendLimits {
            min_ttl: ms(400),
            max_ttl: ms(60_000),
            ttl_step: ms(1),
        };
        assert_eq!(raised.validate(&limits), Ok(()));
    }

    #[test]
    fn node_names_are_valid_and_distinct() {
        assert_eq!(node_name("cron"), "cron");
        assert_eq!(node_name("a/b"), "a%2Fb");
        assert_eq!(node_name("a%2Fb"), "a%252Fb");
        assert_eq!(node_name("."), "%2E");
        assert_eq!(node_name(".."), "%2E%2E");
        assert_eq!(node_name("..."), "...");
        assert_eq!(node_name("h\u{e000}"), "h%EE%80%80");
        assert_eq!(node_name("héllo"), "héllo");
        assert_eq!(node_name("a\u{1F600}"), "a%F0%9F%98%80");
    }

    #[test]
    fn entries_are_ordered_by_sequence() {
        let children = vec![
            "00000000000000ab-1-0000000012".to_string(),
            "junk".to_string(),
            "00000000000000ab-0-0000000003".to_string(),
            "00000000000000cd-7-0000000010".to_string(),
        ];
        let names: Vec<String> = queue_order(children).into_iter().map(|(_, n)| n).collect();
        assert_eq!(
            names,
            [
                "00000000000000ab-0-0000000003",
                "00000000000000cd-7-0000000010",
                "00000000000000ab-1-0000000012"
            ]
        );
        assert_eq!(
            stem("00000000000000ab-1-0000000012"),
            Some("00000000000000ab-1-")
        );
        assert_eq!(sequence("00000000000000ab-1-0000000012"), Some(12));
    }
}

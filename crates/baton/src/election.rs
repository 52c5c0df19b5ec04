//! The public election API: [`Election`], [`Candidacy`], [`Leadership`], [`Observer`].

use std::time::Duration;

use baton_core::{ElectionConfig, LossReason};
use serde::Serialize;
use tokio::sync::{mpsc, oneshot, watch};

use crate::backend::{Backend, Fencer};
use crate::error::{Error, Result};
use crate::fenced::{FencedTxn, FencedTxnResponse};
use crate::health::LeaseHealth;
use crate::lease_driver::{LeaseView, LeaseWatch};
use crate::runner::Runner;
use crate::url::is_reserved;

/// Bound on a fenced operation, as on every other request.
const REQUEST_TIMEOUT: Duration = Duration::from_secs(5);

/// A candidate of an election as anyone can observe it: the leader, or a waiter in the queue.
#[derive(Debug, Clone, PartialEq, Eq, Serialize)]
pub struct LeaderInfo {
    /// The candidate's id.
    pub id: String,
    /// The candidate's entry revision: for the leader, its fencing token.
    pub token: u64,
    /// The value the candidate published (say, its address), if any.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub value: Option<String>,
}

impl LeaderInfo {
    /// The candidate an entry describes: its position, and its stored value (see
    /// [`entry_value`]).
    pub(crate) fn from_entry(position: u64, raw: &[u8]) -> LeaderInfo {
        let text = String::from_utf8_lossy(raw);
        let (id, value) = match text.split_once('\n') {
            Some((id, value)) => (id.to_string(), Some(value.to_string())),
            None => (text.into_owned(), None),
        };
        LeaderInfo {
            id,
            token: position,
            value,
        }
    }
}

/// What every backend stores in a candidate's entry: its id, then, if it has one, a newline and
/// its leader value (ids contain no control characters, so the first newline separates them).
pub(crate) fn entry_value(id: &str, value: Option<&str>) -> String {
    match value {
        Some(value) => format!("{id}\n{value}"),
        None => id.to_string(),
    }
}

/// The largest leader value a candidate may publish.
const MAX_VALUE_BYTES: usize = 64 * 1024;

/// Options of one candidacy beyond its id.
#[derive(Debug, Clone, Default)]
pub struct CandidateOptions {
    value: Option<String>,
    campaign_timeout: Option<Duration>,
}

impl CandidateOptions {
    /// Publishes `value` with the candidacy (say, the address where the leader serves): it is
    /// shown by [`Election::leader`], [`Election::participants`], observers and `baton leader`.
    pub fn with_value(mut self, value: impl Into<String>) -> CandidateOptions {
        self.value = Some(value.into());
        self
    }

    /// Gives up campaigning after `timeout` ([`Election::campaign_with`]): the campaign leaves
    /// the queue and fails with [`Error::Timeout`].
    pub fn with_campaign_timeout(mut self, timeout: Duration) -> CandidateOptions {
        self.campaign_timeout = Some(timeout);
        self
    }
}

/// What a candidacy campaigns with.
#[derive(Debug, Clone)]
pub(crate) struct CandidateSpec {
    pub(crate) election: String,
    pub(crate) id: String,
    pub(crate) value: Option<String>,
    pub(crate) config: ElectionConfig,
}

/// Commands from handles to a candidate's driver task.
#[derive(Debug)]
pub(crate) enum Command {
    /// Resign and acknowledge once the entry is deleted. With a token, only if that term of
    /// office is still the current one: a `Leadership` of an earlier term (with requeue) must
    /// not end a later one when it is dropped.
    Resign {
        term: Option<u64>,
        ack: Option<oneshot::Sender<()>>,
    },
}

/// A leadership's status as its driver sees it.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum Status {
    Leading,
    Lost(LossReason),
    Resigned,
}

/// Backend-specific means to make writes that only succeed while a token leads.
pub(crate) type GuardContext = std::sync::Arc<dyn Fencer>;

/// A named job that needs exactly one leader.
///
/// ```
/// # #[tokio::main] async fn main() -> baton::Result<()> {
/// # let url = std::env::var("BATON_BACKEND").unwrap_or("etcd://127.0.0.1:2379/baton".into());
/// use baton::{Backend, Election, ElectionConfig};
/// use std::time::Duration;
///
/// let backend = Backend::connect(&url).await?;
/// let config = ElectionConfig::default().with_ttl(Duration::from_secs(5));
/// let election = Election::new(&backend, "cron", config)?;
/// let leadership = election.campaign("host-a").await?;
/// let token = leadership.token();
/// tokio::select! {
///     reason = leadership.lost() => eprintln!("lost leadership: {reason}"),
///     _ = async { /* do the job, passing `token` to every fenced write */ } => {}
/// }
/// leadership.resign().await;
/// # Ok(()) }
/// ```
#[derive(Debug, Clone)]
pub struct Election {
    backend: Backend,
    name: String,
    config: ElectionConfig,
}

impl Election {
    /// An election named `name` on `backend`. Validates the name and the configuration
    /// (including the backend's minimum TTL).
    pub fn new(backend: &Backend, name: &str, config: ElectionConfig) -> Result<Election> {
        validate_election_name("election name", name)?;
        if crate::shards::is_shard_election(name) {
            return Err(Error::InvalidName {
                what: "election name",
                value: name.to_string(),
                reason: "is reserved for shard groups (`@members:` and `@shard:` names)",
            });
        }
        Election::unchecked(backend, name, config)
    }

    /// An election of a shard group (a name users cannot give [`Election::new`]).
    pub(crate) fn for_shards(
        backend: &Backend,
        name: &str,
        config: ElectionConfig,
    ) -> Result<Election> {
        validate_election_name("shard election", name)?;
        Election::unchecked(backend, name, config)
    }

    fn unchecked(backend: &Backend, name: &str, config: ElectionConfig) -> Result<Election> {
        backend.validate_config(&config)?;
        Ok(Election {
            backend: backend.clone(),
            name: name.to_string(),
            config,
        })
    }

    /// The election's name.
    pub fn name(&self) -> &str {
        &self.name
    }

    /// The configuration.
    pub fn config(&self) -> &ElectionConfig {
        &self.config
    }

    /// Campaigns for one term of office as `id` and returns when elected. Fails if the
    /// campaign ends first. The returned [`Leadership`] resigns when dropped, and that ends it:
    /// requeue does not apply here (it needs a [`Candidacy`] to receive the next term).
    ///
    /// Cancel-safe: dropping the future leaves the queue.
    pub async fn campaign(&self, id: &str) -> Result<Leadership> {
        self.campaign_with(id, CandidateOptions::default()).await
    }

    /// [`Election::campaign`] with options: a leader value, a campaign timeout.
    pub async fn campaign_with(&self, id: &str, options: CandidateOptions) -> Result<Leadership> {
        let timeout = options.campaign_timeout;
        let mut candidacy = self.start_candidacy(id, options, false)?;
        match timeout {
            Some(limit) => candidacy.next_within(limit).await,
            None => candidacy.next().await,
        }
    }

    /// Starts a candidacy as `id`. With `requeue` in the config it campaigns again after each
    /// loss or resigned term, yielding one [`Leadership`] per term from [`Candidacy::next`].
    ///
    /// The rule of requeue: **a candidacy campaigns for a new term only while its `Candidacy`
    /// exists.** Dropping the `Candidacy` stops campaigning; a term already won lives on in its
    /// [`Leadership`] and, when that ends, nothing campaigns again. To stop everything at once,
    /// current term included, call [`Candidacy::resign`].
    ///
    /// Ids must be unique among the election's live candidates: a second one with the same id
    /// fails with [`Error::DuplicateId`] (with requeue it keeps trying, with a warning, until
    /// the other one is gone).
    pub fn candidacy(&self, id: &str) -> Result<Candidacy> {
        self.candidacy_with(id, CandidateOptions::default())
    }

    /// [`Election::candidacy`] with options (a leader value; the campaign timeout applies to
    /// [`Election::campaign_with`] only, use [`Candidacy::next_within`] here).
    pub fn candidacy_with(&self, id: &str, options: CandidateOptions) -> Result<Candidacy> {
        self.start_candidacy(id, options, self.config.requeue)
    }

    /// A callback-style runner for candidate `id`: see [`Runner`].
    pub fn runner(&self, id: &str) -> Runner {
        Runner::new(self.clone(), id.to_string())
    }

    /// Every candidate in queue order: the leader first, then the waiters in the order they
    /// would take over.
    pub async fn participants(&self) -> Result<Vec<LeaderInfo>> {
        self.backend.connection().participants(&self.name).await
    }

    pub(crate) fn start_candidacy(
        &self,
        id: &str,
        options: CandidateOptions,
        requeue: bool,
    ) -> Result<Candidacy> {
        validate_name("candidate id", id)?;
        if let Some(value) = &options.value {
            if value.len() > MAX_VALUE_BYTES {
                return Err(Error::InvalidName {
                    what: "leader value",
                    value: format!("{}…", value.chars().take(32).collect::<String>()),
                    reason: "must be at most 64 KiB",
                });
            }
        }
        let spec = CandidateSpec {
            election: self.name.clone(),
            id: id.to_string(),
            value: options.value,
            config: self.config.clone().with_requeue(requeue),
        };
        crate::metrics::campaigning(&self.name);
        let (leaderships_tx, leaderships) = mpsc::channel(1);
        let (commands, commands_rx) = mpsc::channel(4);
        self.backend.connection().clone().spawn_candidate(
            spec,
            commands_rx,
            commands.clone(),
            leaderships_tx,
        );
        Ok(Candidacy {
            leaderships,
            commands,
        })
    }

    /// The current leader, if any.
    pub async fn leader(&self) -> Result<Option<LeaderInfo>> {
        self.backend.connection().leader(&self.name).await
    }

    /// Observes the leader: the current state first, then every change, including "no
    /// leader". Changes are never dropped; a slow reader slows the observer, not the election.
    pub async fn observe(&self) -> Result<Observer> {
        let (tx, rx) = mpsc::channel::<Observed>(256);
        self.backend
            .connection()
            .clone()
            .spawn_observer(self.name.clone(), tx)
            .await?;
        Ok(Observer { rx })
    }

    /// Writes `value` at `key` only if `token` still leads this election, atomically with the
    /// check (fencing inside the coordination service). Fails with [`Error::Fenced`] otherwise,
    /// and with [`Error::InvalidKey`] for a key inside baton's candidate entries.
    pub async fn guarded_put(&self, token: u64, key: &str, value: &str) -> Result<()> {
        let txn = FencedTxn::new().then_put(key, value);
        self.fenced_txn(token, txn).await.map(|_| ())
    }

    /// Runs `txn` only if `token` still leads this election, atomically with the check. Fails
    /// with [`Error::Fenced`] otherwise. Bounded by the backend's request timeout.
    pub async fn fenced_txn(&self, token: u64, txn: FencedTxn) -> Result<FencedTxnResponse> {
        self.backend
            .connection()
            .fenced_txn(&self.name, token, &txn, REQUEST_TIMEOUT)
            .await
    }
}

/// A name or id: not empty, at most 256 bytes, no control characters.
pub(crate) fn validate_name(what: &'static str, value: &str) -> Result<()> {
    let reason = if value.is_empty() {
        Some("must not be empty")
    } else if value.len() > 256 {
        Some("must be at most 256 bytes")
    } else if value.chars().any(char::is_control) {
        Some("must not contain control characters")
    } else {
        None
    };
    invalid_if(what, value, reason)
}

/// An election's name: a valid name that is one segment of the backend's keys or paths.
pub(crate) fn validate_election_name(what: &'static str, value: &str) -> Result<()> {
    validate_name(what, value)?;
    let reason = if value.contains('/') {
        Some("must not contain '/'")
    } else if is_reserved(value) {
        // Reserved: it separates an election's name from its candidates' entries.
        Some("is reserved (it separates an election from its candidates' keys)")
    } else {
        None
    };
    invalid_if(what, value, reason)
}

/// `Err(InvalidName)` with `reason`, if there is one.
pub(crate) fn invalid_if(
    what: &'static str,
    value: &str,
    reason: Option<&'static str>,
) -> Result<()> {
    match reason {
        Some(reason) => Err(Error::InvalidName {
            what,
            value: value.to_string(),
            reason,
        }),
        None => Ok(()),
    }
}

/// A running campaign that may yield several leaderships (with requeue).
///
/// Dropping it stops campaigning: no new term is campaigned for, while a current
/// [`Leadership`] keeps its own handle until it ends.
#[derive(Debug)]
pub struct Candidacy {
    /// Boxed: a channel allocates room for 32 items up front, and a candidacy mostly waits.
    leaderships: mpsc::Receiver<Box<Result<Leadership>>>,
    commands: mpsc::Sender<Command>,
}

impl Candidacy {
    /// Waits for the next leadership. Errors when the candidacy ended without one.
    ///
    /// Cancel-safe: a leadership won while nobody was waiting is kept for the next call.
    pub async fn next(&mut self) -> Result<Leadership> {
        self.leaderships
            .recv()
            .await
            .map_or(Err(Error::Closed), |slot| *slot)
    }

    /// [`Candidacy::next`], failing with [`Error::Timeout`] if no leadership comes within
    /// `timeout`. The candidacy stays in the queue; drop it (or resign) to leave.
    pub async fn next_within(&mut self, timeout: Duration) -> Result<Leadership> {
        match tokio::time::timeout(timeout, self.next()).await {
            Ok(result) => result,
            Err(_) => Err(Error::Timeout {
                operation: "campaign",
                after_ms: u64::try_from(timeout.as_millis()).unwrap_or(u64::MAX),
            }),
        }
    }

    /// Stops campaigning and deletes our entry, ending the current term if we lead; waits until
    /// it is gone (at most 10 s: if the backend is unreachable the entry goes with the lease
    /// instead). This is the way to shut a requeueing candidacy down.
    pub async fn resign(self) {
        let (ack, done) = oneshot::channel();
        let resign = Command::Resign {
            term: None,
            ack: Some(ack),
        };
        if self.commands.send(resign).await.is_ok() {
            let _ = tokio::time::timeout(Duration::from_secs(10), done).await;
        }
    }
}

/// Leadership of one election, from election until loss or resignation.
///
/// Safety rule 1 lives here: [`Leadership::lost`] resolves at the latest at the local
/// deadline, measured by this handle's own timer, even if the driver task or the server is
/// silent. Stop acting when it resolves. Safety rule 2: pass [`Leadership::token`] with every
/// action to a fenced resource.
#[derive(Debug)]
pub struct Leadership {
    election: String,
    id: String,
    token: u64,
    status: watch::Receiver<Status>,
    lease: LeaseWatch,
    commands: mpsc::Sender<Command>,
    guard: GuardContext,
    resigned: bool,
    /// Dropped with the leadership: tells whoever holds the receiver that its holder let go.
    dropped: Option<oneshot::Sender<()>>,
}

impl Leadership {
    pub(crate) fn new(
        election: String,
        id: String,
        token: u64,
        status: watch::Receiver<Status>,
        lease: LeaseWatch,
        commands: mpsc::Sender<Command>,
        guard: GuardContext,
    ) -> Leadership {
        Leadership {
            election,
            id,
            token,
            status,
            lease,
            commands,
            guard,
            resigned: false,
            dropped: None,
        }
    }

    /// The election's name.
    pub fn election(&self) -> &str {
        &self.election
    }

    /// Our candidate id.
    pub fn id(&self) -> &str {
        &self.id
    }

    /// The fencing token: strictly greater than any earlier leader's in this election.
    pub fn token(&self) -> u64 {
        self.token
    }

    /// The local deadline now in force, or `None` once the lease is over.
    ///
    /// Deadlines count time the host spent suspended (`CLOCK_BOOTTIME`), which tokio's clock
    /// does not: this is tokio's now plus the time remaining, so after a resume from a suspend
    /// beyond the deadline it is already in the past.
    pub fn deadline(&self) -> Option<tokio::time::Instant> {
        self.lease.tokio_deadline()
    }

    /// The lease under this leadership, for health checks: see [`LeaseHealth`].
    pub fn lease_health(&self) -> LeaseHealth {
        LeaseHealth::new(self.lease.clone())
    }

    /// Whether we may still act: not lost, and before the local deadline (counting time the
    /// host spent suspended).
    pub fn is_leading(&self) -> bool {
        *self.status.borrow() == Status::Leading && self.lease.is_live()
    }

    /// Resolves when leadership is over, at the latest at the local deadline (after a suspend
    /// beyond it, as soon as the host resumes).
    ///
    /// Cancel-safe, and callable any number of times: inside `select!` it can be dropped and
    /// awaited again without missing the loss.
    pub async fn lost(&self) -> LossReason {
        wait_lost(self.status.clone(), self.lease.clone()).await
    }

    /// Writes `value` at `key` in the coordination service only while this leadership holds,
    /// atomically with the check. Fails with [`Error::Fenced`] otherwise.
    pub async fn guarded_put(&self, key: &str, value: &str) -> Result<()> {
        let txn = FencedTxn::new().then_put(key, value);
        self.fenced_txn(txn).await.map(|_| ())
    }

    /// Reads `key` only while this leadership holds (a deposed leader must not act on what it
    /// reads). `None` if the key does not exist.
    pub async fn fenced_get(&self, key: &str) -> Result<Option<Vec<u8>>> {
        let response = self.fenced_txn(FencedTxn::new().then_get(key)).await?;
        Ok(response.values.into_iter().next().flatten())
    }

    /// Deletes `key` only while this leadership holds; returns whether it existed.
    pub async fn fenced_delete(&self, key: &str) -> Result<bool> {
        // Absent: nothing to delete. Present: the comparison fails and the delete runs.
        let txn = FencedTxn::new().when_value(key, None).otherwise_delete(key);
        let response = self.fenced_txn(txn).await?;
        Ok(!response.succeeded)
    }

    /// Runs `txn` (compare-and-swap: see [`FencedTxn`]) only while this leadership holds,
    /// atomically with the check. Fails with [`Error::Fenced`] once it no longer holds.
    /// Bounded by the backend's request timeout and by the local deadline.
    ///
    /// Cancel-safe in the sense that dropping it never leaves a partial transaction: it either
    /// ran whole at the server or not at all (which, once sent, you cannot know).
    pub async fn fenced_txn(&self, txn: FencedTxn) -> Result<FencedTxnResponse> {
        let fenced = || Error::Fenced {
            election: self.election.clone(),
            token: self.token,
        };
        if !self.is_leading() {
            return Err(fenced());
        }
        let left = self
            .deadline()
            .map_or(Duration::ZERO, |d| {
                d.saturating_duration_since(tokio::time::Instant::now())
            })
            .min(REQUEST_TIMEOUT);
        if left.is_zero() {
            return Err(fenced());
        }
        self.guard.run(&self.election, self.token, &txn, left).await
    }

    /// Resigns this term of office: deletes our entry so a successor can start at once, and
    /// waits until it is gone (at most 10 s). Without requeue that ends the candidacy; with
    /// requeue the candidacy campaigns again if its [`Candidacy`] still exists
    /// ([`Candidacy::resign`] ends it for good). Dropping a `Leadership` does the same without
    /// waiting.
    pub async fn resign(mut self) {
        self.resigned = true;
        let (ack, done) = oneshot::channel();
        let resign = Command::Resign {
            term: Some(self.token),
            ack: Some(ack),
        };
        if self.commands.send(resign).await.is_ok() {
            let _ = tokio::time::timeout(Duration::from_secs(10), done).await;
        }
    }
}

/// How a leadership ended: see [`Leadership::ending`].
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum Ended {
    /// Resigned (or dropped) by its holder.
    Resigned,
    /// Lost.
    Lost(LossReason),
}

impl Leadership {
    /// Resolves once this handle is dropped (or resigned): its holder has stopped acting.
    pub(crate) fn drop_signal(&mut self) -> oneshot::Receiver<()> {
        let (tx, rx) = oneshot::channel();
        self.dropped = Some(tx);
        rx
    }

    /// Resolves when this leadership ends (as [`Leadership::lost`] does), telling a resign by
    /// its holder from a loss; it does not borrow the leadership, which may be handed on.
    pub(crate) fn ending(&self) -> impl std::future::Future<Output = Ended> + Send + 'static {
        let (status, lease) = (self.status.clone(), self.lease.clone());
        async move {
            let reason = wait_lost(status.clone(), lease).await;
            if *status.borrow() == Status::Resigned {
                Ended::Resigned
            } else {
                Ended::Lost(reason)
            }
        }
    }
}

impl Drop for Leadership {
    fn drop(&mut self) {
        if !self.resigned {
            // Best effort: the driver resigns; if the channel is full a resign is already queued
            // or the driver is gone, and the lease expiry cleans up.
            let _ = self.commands.try_send(Command::Resign {
                term: Some(self.token),
                ack: None,
            });
        }
    }
}

/// Waits until a leadership with this status and lease is over: the driver reports a loss, the
/// lease is over, or the local deadline passes on this future's own timer, whichever is first.
/// Safety rule 1 does not depend on the driver task being scheduled in time. (This timer is
/// tokio's, which does not count a suspend; after a resume the lease driver's
/// `CLOCK_BOOTTIME` alarm ends the lease instead.)
pub(crate) async fn wait_lost(
    mut status: watch::Receiver<Status>,
    lease: LeaseWatch,
) -> LossReason {
    let LeaseWatch {
        view: mut lease,
        clock,
        ..
    } = lease;
    loop {
        match *status.borrow_and_update() {
            Status::Leading => {}
            Status::Lost(reason) => return reason,
            // After resign we are no longer leading; report it as the lease being over.
            Status::Resigned => return LossReason::LeaseExpired,
        }
        let deadline = match *lease.borrow_and_update() {
            LeaseView::Live { deadline } => deadline,
            LeaseView::Over => return LossReason::LeaseExpired,
        };
        if clock.now() >= deadline {
            return LossReason::LeaseExpired;
        }
        // Once tokio's clock has moved by the time remaining, the timeline has moved at least
        // as far (it also counts suspended time): the deadline has passed.
        tokio::select! {
            _ = tokio::time::sleep_until(clock.to_tokio(deadline)) => return LossReason::LeaseExpired,
            changed = status.changed() => {
                if changed.is_err() {
                    // The driver is gone: nobody renews or watches for us any more.
                    return LossReason::BackendFailed;
                }
            }
            changed = lease.changed() => {
                if changed.is_err() {
                    return LossReason::LeaseExpired;
                }
            }
        }
    }
}

/// What an [`Observer`] sees.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Observed {
    /// The current leader; `None` means the election has no leader.
    Leader(Option<LeaderInfo>),
    /// The backend cannot be seen right now (unreachable, not answering within a second, or the
    /// watch broke): the last leader reported may be stale. The observer keeps trying, and a
    /// `Leader` follows as soon as the backend can be seen again.
    Unavailable {
        /// What went wrong, in one line.
        reason: String,
    },
}

/// A stream of leader states: the current one first, then each change (including "no
/// leader"), with [`Observed::Unavailable`] when the backend cannot be seen. Also a
/// [`futures_core::Stream`] of [`Observed`]; the stream ends only when its backend is closed.
#[derive(Debug)]
pub struct Observer {
    rx: mpsc::Receiver<Observed>,
}

impl Observer {
    /// The next state; `None` once the observer has ended. Cancel-safe: no state is lost when
    /// the future is dropped inside `select!`.
    pub async fn next(&mut self) -> Option<Observed> {
        self.rx.recv().await
    }
}

impl futures_core::Stream for Observer {
    type Item = Observed;

    fn poll_next(
        mut self: std::pin::Pin<&mut Self>,
        cx: &mut std::task::Context<'_>,
    ) -> std::task::Poll<Option<Observed>> {
        self.rx.poll_recv(cx)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn names_are_validated() {
        assert!(validate_election_name("election name", "cron").is_ok());
        for bad in ["", "a/b", "x\ny", "@candidates"] {
            let message = validate_election_name("election name", bad)
                .unwrap_err()
                .to_string();
            assert!(message.starts_with("invalid election name"), "{message}");
        }
        assert!(validate_election_name("election name", "@candidates2").is_ok());
        assert!(validate_name("candidate id", "host/1").is_ok());
        assert!(validate_name("candidate id", "@candidates").is_ok());
        assert!(validate_name("candidate id", &"x".repeat(300)).is_err());
    }
}

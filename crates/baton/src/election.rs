//! The public election API: [`Election`], [`Candidacy`], [`Leadership`], [`Observer`].

use std::time::Duration;

use baton_core::{ElectionConfig, LossReason};
use serde::Serialize;
use tokio::sync::{mpsc, oneshot, watch};

use crate::backend::{Backend, BackendKind};
use crate::error::{Error, Result};
use crate::health::LeaseHealth;
use crate::session::{LeaseView, LeaseWatch};
use crate::url::CANDIDATES_MARKER;

/// The current leader of an election, as anyone can observe it.
#[derive(Debug, Clone, PartialEq, Eq, Serialize)]
pub struct LeaderInfo {
    /// The leader's candidate id.
    pub id: String,
    /// The leader's fencing token.
    pub token: u64,
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
#[derive(Clone)]
pub(crate) enum GuardContext {
    #[cfg(feature = "etcd")]
    Etcd {
        client: etcd_client::Client,
        /// The leader key whose create revision is the token.
        key: Vec<u8>,
    },
}

impl std::fmt::Debug for GuardContext {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            #[cfg(feature = "etcd")]
            GuardContext::Etcd { key, .. } => f
                .debug_struct("Etcd")
                .field("key", &String::from_utf8_lossy(key))
                .finish(),
        }
    }
}

/// A named job that needs exactly one leader.
///
/// ```no_run
/// # async fn demo() -> baton::Result<()> {
/// use baton::{Backend, Election, ElectionConfig};
/// use std::time::Duration;
///
/// let backend = Backend::connect("etcd://127.0.0.1:2379/baton").await?;
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
        validate_name("election name", name)?;
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

    /// Campaigns once as `id` and returns when elected. Fails if the candidacy ends first.
    /// The returned [`Leadership`] resigns when dropped.
    pub async fn campaign(&self, id: &str) -> Result<Leadership> {
        let mut candidacy = self.candidacy(id)?;
        candidacy.next().await
    }

    /// Starts a candidacy as `id`. With `requeue` in the config it campaigns again after each
    /// loss, yielding one [`Leadership`] per term of office from [`Candidacy::next`].
    pub fn candidacy(&self, id: &str) -> Result<Candidacy> {
        validate_name("candidate id", id)?;
        crate::metrics::campaigning(&self.name);
        let (leaderships_tx, leaderships) = mpsc::channel(1);
        let (commands, commands_rx) = mpsc::channel(4);
        match self.backend.kind() {
            #[cfg(feature = "etcd")]
            BackendKind::Etcd(etcd) => etcd.spawn_candidate(
                self.name.clone(),
                id.to_string(),
                self.config.clone(),
                commands_rx,
                commands.clone(),
                leaderships_tx,
            ),
        }
        Ok(Candidacy {
            leaderships,
            commands,
        })
    }

    /// The current leader, if any.
    pub async fn leader(&self) -> Result<Option<LeaderInfo>> {
        match self.backend.kind() {
            #[cfg(feature = "etcd")]
            BackendKind::Etcd(etcd) => etcd.leader(&self.name).await,
        }
    }

    /// Observes the leader: the current state first, then every change, including "no
    /// leader". Changes are never dropped; a slow reader slows the observer, not the election.
    pub async fn observe(&self) -> Result<Observer> {
        let (tx, rx) = mpsc::channel(256);
        match self.backend.kind() {
            #[cfg(feature = "etcd")]
            BackendKind::Etcd(etcd) => etcd.spawn_observer(self.name.clone(), tx).await?,
        }
        Ok(Observer { rx })
    }

    /// Writes `value` at `key` only if `token` still leads this election, atomically with the
    /// check (fencing inside the coordination service). Fails with [`Error::Fenced`] otherwise.
    pub async fn guarded_put(&self, token: u64, key: &str, value: &str) -> Result<()> {
        match self.backend.kind() {
            #[cfg(feature = "etcd")]
            BackendKind::Etcd(etcd) => {
                etcd.guarded_put_by_token(&self.name, token, key, value)
                    .await
            }
        }
    }
}

fn validate_name(what: &'static str, value: &str) -> Result<()> {
    let reason = if value.is_empty() {
        Some("must not be empty")
    } else if value.len() > 256 {
        Some("must be at most 256 bytes")
    } else if what == "election name" && value.contains('/') {
        Some("must not contain '/'")
    } else if what == "election name" && value == CANDIDATES_MARKER {
        // Reserved: it separates an election's name from its candidates' entries.
        Some("is reserved (it separates an election from its candidates' keys)")
    } else if value.chars().any(char::is_control) {
        Some("must not contain control characters")
    } else {
        None
    };
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
/// Dropping it stops campaigning (a current [`Leadership`] keeps its own handle).
#[derive(Debug)]
pub struct Candidacy {
    /// Boxed: a channel allocates room for 32 items up front, and a candidacy mostly waits.
    leaderships: mpsc::Receiver<Box<Result<Leadership>>>,
    commands: mpsc::Sender<Command>,
}

impl Candidacy {
    /// Waits for the next leadership. Errors when the candidacy ended without one.
    pub async fn next(&mut self) -> Result<Leadership> {
        self.leaderships
            .recv()
            .await
            .map_or(Err(Error::Closed), |slot| *slot)
    }

    /// Stops campaigning and deletes our entry; waits until it is gone (at most 10 s: if the
    /// backend is unreachable the entry goes with the lease instead).
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
    pub async fn lost(&self) -> LossReason {
        wait_lost(self.status.clone(), self.lease.clone()).await
    }

    /// Writes `value` at `key` in the coordination service only while this leadership holds,
    /// atomically with the check. Fails with [`Error::Fenced`] otherwise.
    pub async fn guarded_put(&self, key: &str, value: &str) -> Result<()> {
        if !self.is_leading() {
            return Err(Error::Fenced {
                election: self.election.clone(),
                token: self.token,
            });
        }
        match &self.guard {
            #[cfg(feature = "etcd")]
            GuardContext::Etcd {
                client,
                key: leader_key,
            } => {
                crate::etcd::guarded_put(
                    client.clone(),
                    &self.election,
                    leader_key.clone(),
                    self.token,
                    key,
                    value,
                )
                .await
            }
        }
    }

    /// Resigns this term of office: deletes our entry so a successor can start at once, and
    /// waits until it is gone (at most 10 s). Without requeue that ends the candidacy; with
    /// requeue the candidacy campaigns again ([`Candidacy::resign`] ends it for good). Dropping
    /// a `Leadership` does the same without waiting.
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

/// A stream of leader states: the current one first, then each change.
#[derive(Debug)]
pub struct Observer {
    rx: mpsc::Receiver<Result<Option<LeaderInfo>>>,
}

impl Observer {
    /// The next state: `Some` leader or `None` for no leader. An `Err` is final.
    pub async fn next(&mut self) -> Result<Option<LeaderInfo>> {
        self.rx.recv().await.unwrap_or(Err(Error::Closed))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn names_are_validated() {
        assert!(validate_name("election name", "cron").is_ok());
        for bad in ["", "a/b", "x\ny", "@candidates"] {
            let message = validate_name("election name", bad).unwrap_err().to_string();
            assert!(message.starts_with("invalid election name"), "{message}");
        }
        assert!(validate_name("election name", "@candidates2").is_ok());
        assert!(validate_name("candidate id", "host/1").is_ok());
        assert!(validate_name("candidate id", "@candidates").is_ok());
        assert!(validate_name("candidate id", &"x".repeat(300)).is_err());
    }
}

//! Connecting to a backend by URL.

use std::future::Future;
use std::pin::Pin;
use std::sync::Arc;
use std::time::Duration;

use baton_core::{BackendLimits, ElectionConfig};
use tokio::sync::mpsc;

use crate::election::{CandidateSpec, Command, LeaderInfo, Leadership, Observed};
use crate::error::{Error, Result};
use crate::fenced::{FencedTxn, FencedTxnResponse};
use crate::stats::StatsSnapshot;
use crate::url::BackendUrl;

/// A boxed future, for the object-safe backend traits.
pub(crate) type BoxFuture<'a, T> = Pin<Box<dyn Future<Output = T> + Send + 'a>>;

/// What the public API needs of a connected backend. Object-safe: [`Backend`] holds one as
/// `Arc<dyn Connection>`, so nothing above this trait knows which backend it talks to.
pub(crate) trait Connection: Send + Sync + std::fmt::Debug + 'static {
    /// What this backend's leases can be.
    fn limits(&self) -> BackendLimits;

    /// Counters of the requests and events handled so far.
    fn stats(&self) -> StatsSnapshot;

    /// Ends every lease this connection holds, at the server.
    fn close(&self) -> BoxFuture<'_, ()>;

    /// Starts the driver of one candidacy (see [`crate::driver::spawn`]).
    fn spawn_candidate(
        self: Arc<Self>,
        spec: CandidateSpec,
        commands_rx: mpsc::Receiver<Command>,
        commands: mpsc::Sender<Command>,
        leaderships: mpsc::Sender<Box<Result<Leadership>>>,
    );

    /// The current leader of `election`, if any.
    fn leader<'a>(&'a self, election: &'a str) -> BoxFuture<'a, Result<Option<LeaderInfo>>>;

    /// Every candidate of `election` in queue order.
    fn participants<'a>(&'a self, election: &'a str) -> BoxFuture<'a, Result<Vec<LeaderInfo>>>;

    /// Starts an observer task that sends the current leader, then every change, on `tx`.
    fn spawn_observer(
        self: Arc<Self>,
        election: String,
        tx: mpsc::Sender<Observed>,
    ) -> BoxFuture<'static, Result<()>>;

    /// Runs `txn` only while `token` leads `election`, atomically with the check.
    fn fenced_txn<'a>(
        &'a self,
        election: &'a str,
        token: u64,
        txn: &'a FencedTxn,
        limit: Duration,
    ) -> BoxFuture<'a, Result<FencedTxnResponse>>;
}

/// The means a [`crate::Leadership`] has to write only while it leads: backend-specific, held
/// as a trait object.
pub(crate) trait Fencer: Send + Sync + std::fmt::Debug + 'static {
    /// Runs `txn` only while the leadership of `token` in `election` holds, atomically with
    /// the check, within `limit`.
    fn run<'a>(
        &'a self,
        election: &'a str,
        token: u64,
        txn: &'a FencedTxn,
        limit: Duration,
    ) -> BoxFuture<'a, Result<FencedTxnResponse>>;
}

/// A connection to a coordination service. Cheap to clone; clones share leases and
/// connections, so one process holding many elections renews one lease per configuration.
#[derive(Debug, Clone)]
pub struct Backend {
    connection: Arc<dyn Connection>,
}

impl Backend {
    /// Connects to the backend named by `url` and checks that it answers.
    ///
    /// URLs: `etcd://host:port[,host:port]/prefix` (also `baton server`),
    /// `zk://host:port[,host:port]/chroot` (also `zookeeper://`; feature `zookeeper`),
    /// `postgres://user[:password]@host:port/db?schema=NAME` (also `postgresql://`; feature
    /// `postgres`),
    /// `memory://NAME` (a store inside this process, for tests: see [`crate::MemoryStore`]).
    pub async fn connect(url: &str) -> Result<Backend> {
        match BackendUrl::parse(url)? {
            #[cfg(feature = "postgres")]
            BackendUrl::Postgres { url, schema } => Ok(Backend {
                connection: Arc::new(crate::postgres::PgBackend::connect(&url, schema).await?),
            }),
            #[cfg(not(feature = "postgres"))]
            BackendUrl::Postgres { .. } => Err(Error::InvalidUrl {
                url: crate::url::redact(url),
                reason: "this build has no PostgreSQL support (feature \"postgres\")".into(),
            }),
            BackendUrl::Memory { name } => Ok(Backend {
                connection: Arc::new(crate::memory::MemoryBackend::connect(&name)?),
            }),
            #[cfg(feature = "etcd")]
            BackendUrl::Etcd { endpoints, prefix } => {
                let etcd = crate::etcd::EtcdBackend::connect(endpoints, prefix).await?;
                Ok(Backend {
                    connection: Arc::new(etcd),
                })
            }
            #[cfg(not(feature = "etcd"))]
            BackendUrl::Etcd { .. } => Err(Error::InvalidUrl {
                url: url.to_string(),
                reason: "this build has no etcd support (feature \"etcd\")".into(),
            }),
            #[cfg(feature = "zookeeper")]
            BackendUrl::ZooKeeper { endpoints, chroot } => {
                let zookeeper = crate::zookeeper::ZkBackend::connect(endpoints, chroot).await?;
                Ok(Backend {
                    connection: Arc::new(zookeeper),
                })
            }
            #[cfg(not(feature = "zookeeper"))]
            BackendUrl::ZooKeeper { .. } => Err(Error::InvalidUrl {
                url: url.to_string(),
                reason: "this build has no ZooKeeper support (feature \"zookeeper\")".into(),
            }),
        }
    }

    pub(crate) fn connection(&self) -> &Arc<dyn Connection> {
        &self.connection
    }

    /// What this backend can hold (TTL bounds and step): a configuration that passes
    /// `config.validate(&backend.limits())` is one this backend accepts.
    pub fn limits(&self) -> BackendLimits {
        self.connection.limits()
    }

    /// Checks `config` against itself and this backend's limits: the same check
    /// [`crate::Election::new`] makes.
    pub fn validate_config(&self, config: &ElectionConfig) -> Result<()> {
        config.validate(&self.limits())?;
        Ok(())
    }

    /// Counters of the requests and events this backend handled so far.
    pub fn stats(&self) -> StatsSnapshot {
        self.connection.stats()
    }

    /// Revokes every lease this backend holds: all its leaderships and candidacies end at the
    /// server at once. It is final: no candidacy campaigns again (with requeue neither), a
    /// campaign or observer started afterwards fails with [`Error::Closed`], and observers end.
    pub async fn close(&self) {
        self.connection.close().await
    }
}

#[allow(dead_code)]
fn _assert_send_sync() {
    fn is<T: Send + Sync>() {}
    is::<Backend>();
    let _ = Error::Closed;
}

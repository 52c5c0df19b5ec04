//! Connecting to a backend by URL.

use std::sync::Arc;

use baton_core::{BackendLimits, ElectionConfig};

use crate::error::{Error, Result};
use crate::stats::StatsSnapshot;
use crate::url::BackendUrl;

/// A connection to a coordination service. Cheap to clone; clones share leases and
/// connections, so one process holding many elections renews one lease per configuration.
#[derive(Debug, Clone)]
pub struct Backend {
    kind: Arc<BackendKind>,
}

#[derive(Debug)]
pub(crate) enum BackendKind {
    #[cfg(feature = "etcd")]
    Etcd(Arc<crate::etcd::EtcdBackend>),
}

impl Backend {
    /// Connects to the backend named by `url` and checks that it answers.
    ///
    /// URLs: `etcd://host:port[,host:port]/prefix` (also `baton server`).
    pub async fn connect(url: &str) -> Result<Backend> {
        match BackendUrl::parse(url)? {
            #[cfg(feature = "etcd")]
            BackendUrl::Etcd { endpoints, prefix } => {
                let etcd = crate::etcd::EtcdBackend::connect(endpoints, prefix).await?;
                Ok(Backend {
                    kind: Arc::new(BackendKind::Etcd(Arc::new(etcd))),
                })
            }
            #[cfg(not(feature = "etcd"))]
            BackendUrl::Etcd { .. } => Err(Error::InvalidUrl {
                url: url.to_string(),
                reason: "this build has no etcd support (feature \"etcd\")".into(),
            }),
        }
    }

    pub(crate) fn kind(&self) -> &BackendKind {
        &self.kind
    }

    /// What this backend can hold (TTL bounds and step): a configuration that passes
    /// `config.validate(&backend.limits())` is one this backend accepts.
    pub fn limits(&self) -> BackendLimits {
        match self.kind() {
            #[cfg(feature = "etcd")]
            BackendKind::Etcd(_) => crate::etcd::LIMITS,
        }
    }

    /// Checks `config` against itself and this backend's limits: the same check
    /// [`crate::Election::new`] makes.
    pub fn validate_config(&self, config: &ElectionConfig) -> Result<()> {
        config.validate(&self.limits())?;
        Ok(())
    }

    /// Counters of the requests and events this backend handled so far.
    pub fn stats(&self) -> StatsSnapshot {
        match self.kind() {
            #[cfg(feature = "etcd")]
            BackendKind::Etcd(etcd) => etcd.stats.snapshot(),
        }
    }

    /// Revokes every lease this backend holds: all its leaderships and candidacies end at the
    /// server at once.
    pub async fn close(&self) {
        match self.kind() {
            #[cfg(feature = "etcd")]
            BackendKind::Etcd(etcd) => etcd.close().await,
        }
    }
}

#[allow(dead_code)]
fn _assert_send_sync() {
    fn is<T: Send + Sync>() {}
    is::<Backend>();
    let _ = Error::Closed;
}

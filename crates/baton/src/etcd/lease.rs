//! etcd leases: grant, renewals over the keepalive stream, revoke.

use std::sync::atomic::Ordering;
use std::sync::Arc;
use std::time::Duration;

use super::client::{Client, LeaseKeepAliveStream, LeaseKeeper};

use super::{backend_error, request};
use crate::error::{Error, Result};
use crate::lease_driver::LeaseTransport;
use crate::stats::Stats;

/// Grant and renewals of one etcd lease, over the keepalive stream.
pub(super) struct EtcdLeaseTransport {
    pub(super) client: Client,
    pub(super) id: i64,
    pub(super) stream: Option<(LeaseKeeper, LeaseKeepAliveStream)>,
    pub(super) stats: Arc<Stats>,
    pub(super) on_grant: Option<tokio::sync::oneshot::Sender<i64>>,
    /// The server said the lease no longer exists.
    pub(super) gone: bool,
}

impl LeaseTransport for EtcdLeaseTransport {
    async fn grant(&mut self, ttl: Duration) -> Result<Duration> {
        let seconds = i64::try_from(ttl.as_secs()).unwrap_or(i64::MAX);
        // Bounded like every other request: the lease driver's own bound is the local lease,
        // which for a long TTL would leave a campaign hanging on a stalled server for minutes.
        let grant = self.client.lease_grant(seconds);
        let response = request(&self.stats, "lease grant", grant).await?;
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
                // The client reports a lease the server no longer knows (TTL ≤ 0 on the
                // opening renewal) this way: the lease is gone, not the network.
                Err(super::client::Error::LeaseKeepAlive(_)) => {
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
        // Bounded like the grant (the driver's bound is the renew interval, which can be long).
        let revoke = self.client.lease_revoke(self.id);
        request(&self.stats, "lease revoke", revoke)
            .await
            .map(|_| ())
    }
}

//! etcd leases: grant, renewals over the keepalive stream, revoke.

use std::sync::atomic::Ordering;
use std::sync::Arc;
use std::time::Duration;

use super::client::{Client, LeaseKeepAliveStream, LeaseKeeper, Pin};

use super::{backend_error, hedged, request, REQUEST_TIMEOUT};
use crate::error::{Error, Result};
use crate::lease_driver::LeaseTransport;
use crate::stats::Stats;

/// Grant and renewals of one etcd lease, over the keepalive stream.
///
/// With several endpoints the stream is pinned to one that answers ([`Client::pinned`]); it
/// is reopened on another when that one stops answering its checks, and when a renewal on it
/// goes unanswered for an interval (the lease core's [`LeaseTransport::reopen`]).
pub(super) struct EtcdLeaseTransport {
    pub(super) client: Client,
    pub(super) id: i64,
    /// The stream, with the client it was opened on and its endpoint (with several).
    pub(super) stream: Option<Stream>,
    /// The endpoint of the last stream opened or tried: once that one is given up, the next
    /// goes elsewhere (an opening that hangs is given up too).
    pub(super) tried: Option<usize>,
    /// The endpoint to keep away from: the one last given up.
    pub(super) avoid: Option<usize>,
    pub(super) stats: Arc<Stats>,
    pub(super) on_grant: Option<tokio::sync::oneshot::Sender<i64>>,
    /// The server said the lease no longer exists.
    pub(super) gone: bool,
    /// The answer to the renewal a new stream opened with, not yet handed over: it is the
    /// answer to the renewal whose send opened the stream (one round trip fewer than sending
    /// another on it, which counts when a stream is reopened against a lease's deadline).
    pub(super) opened: Option<Duration>,
}

/// An open keepalive stream.
pub(super) struct Stream {
    keeper: LeaseKeeper,
    answers: LeaseKeepAliveStream,
    client: Client,
    endpoint: Option<Pin>,
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
            // The renewal a new stream opens with is this renewal.
            self.stats.renewals.fetch_add(1, Ordering::Relaxed);
            // After a stream went silent, the next goes to the member that answers first.
            let (mut client, endpoint) = self
                .client
                .pinned_elsewhere(self.avoid, super::ELSEWHERE_WAIT)
                .await;
            self.tried = endpoint.map(|pin| pin.index);
            match client.lease_keep_alive(self.id).await {
                Ok((keeper, answers, ttl)) => {
                    self.stream = Some(Stream {
                        keeper,
                        answers,
                        client,
                        endpoint,
                    });
                    self.opened = Some(ttl);
                    return Ok(());
                }
                // The client reports a lease the server no longer knows (TTL ≤ 0 on the
                // opening renewal) this way: the lease is gone, not the network.
                Err(super::client::Error::LeaseKeepAlive(_)) => {
                    self.gone = true;
                    return Ok(());
                }
                Err(error) => return Err(backend_error("lease keepalive", error)),
            }
        }
        let stream = self.stream.as_mut().expect("opened above");
        self.stats.renewals.fetch_add(1, Ordering::Relaxed);
        if let Err(error) = stream.keeper.keep_alive().await {
            self.reopen();
            return Err(backend_error("lease keepalive", error));
        }
        Ok(())
    }

    fn reopen(&mut self) {
        self.stream = None;
        self.opened = None;
        self.avoid = self.tried;
    }

    async fn next_renewal(&mut self) -> Result<Duration> {
        if self.gone {
            return Ok(Duration::ZERO);
        }
        if let Some(ttl) = self.opened.take() {
            return Ok(ttl);
        }
        let Some(stream) = self.stream.as_mut() else {
            return std::future::pending().await;
        };
        let answer = tokio::select! {
            answer = stream.answers.message() => answer,
            // Its endpoint stopped answering checks: renewals on it would go unanswered.
            _ = stream.client.left(stream.endpoint) => {
                self.reopen();
                return Err(Error::Closed);
            }
        };
        match answer {
            Ok(Some(response)) => Ok(Duration::from_secs(response.ttl().max(0) as u64)),
            Ok(None) => {
                self.reopen();
                Err(Error::Closed)
            }
            Err(error) => {
                self.reopen();
                Err(backend_error("lease keepalive", error))
            }
        }
    }

    async fn revoke(&mut self) -> Result<()> {
        // Bounded like the grant (the driver's bound is the renew interval, which can be long),
        // and sent again elsewhere if its member hangs: a second revoke changes nothing.
        let id = self.id;
        let revoke = |mut client: Client| async move { client.lease_revoke(id).await };
        hedged(
            &self.client,
            REQUEST_TIMEOUT,
            &self.stats,
            "lease revoke",
            revoke,
        )
        .await
    }
}

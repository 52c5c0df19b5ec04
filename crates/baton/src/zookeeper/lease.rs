//! Leases on ZooKeeper: one session per lease.
//!
//! - **Grant**: a new session asking for the TTL as its timeout. The server negotiates it into
//!   `[minSessionTimeout, maxSessionTimeout]`; the negotiated timeout is the granted TTL. A
//!   session longer than the TTL asked for is refused (a configuration error): the election's
//!   TTL promises that a dead holder's place is free within it, which such a server would not
//!   keep.
//! - **Renewal**: baton's own `sync`, whose answer baton sees, every renew interval. A `sync`
//!   travels to the ensemble's leader, which checks that the session is still alive there
//!   (a read would be answered by a follower, which may not know yet that the session expired),
//!   and the server it reaches counts it as activity of the session. The client library's own
//!   pings keep the session alive too, but prove nothing to baton: only answered syncs move the
//!   local deadline, from the time they were sent (the generic lease driver does that). While
//!   disconnected the syncs wait and the deadline keeps running; baton never waits for the
//!   session-expired event.
//! - **Loss**: a sync answered "session expired" means the lease is gone (renewal answer zero);
//!   a new lease is a new session.
//! - **Revoke**: close the session (its ephemeral entries go at once). The session's client is
//!   *detached*: dropping it closes the connection but not the session, so a lease that is let
//!   lapse, or that passed its local deadline, ends at the server a session timeout after its
//!   last activity, after every holder's local deadline. Revoking therefore attaches to the
//!   session once more and closes it explicitly.

use std::collections::VecDeque;
use std::sync::atomic::Ordering;
use std::sync::{Arc, Weak};
use std::time::Duration;

use baton_core::{format_duration, ConfigError, ElectionConfig};
use tokio::task::JoinHandle;
use zookeeper_client as zk;

use super::{bounded, zk_error, REQUEST_TIMEOUT};
use crate::driver::QueueLease;
use crate::error::{Error, Result};
use crate::lease_driver::{LeaseHandle, LeaseTransport};
use crate::stats::Stats;

/// One lease: a ZooKeeper session, shared by every candidacy with the same settings.
#[derive(Debug)]
pub(crate) struct ZkLease {
    pub(super) session_id: i64,
    /// The session's client, owned by the lease driver: gone once the lease has ended.
    pub(super) client: Weak<zk::Client>,
    pub(super) handle: LeaseHandle,
}

impl ZkLease {
    /// The session's client, to create entries owned by it.
    pub(super) fn client(&self) -> Result<Arc<zk::Client>> {
        self.client.upgrade().ok_or_else(|| Error::Backend {
            backend: super::BACKEND,
            operation: "create candidate entry",
            detail: "the lease's session has ended".into(),
            retryable: true,
            source: None,
        })
    }
}

impl QueueLease for ZkLease {
    fn handle(&self) -> &LeaseHandle {
        &self.handle
    }
}

/// The grant, renewals and revoke of one session.
pub(super) struct ZkLeaseTransport {
    hosts: String,
    config: ElectionConfig,
    stats: Arc<Stats>,
    /// The session's client, once granted; the only strong reference outside requests.
    client: Option<Arc<zk::Client>>,
    /// The negotiated session timeout.
    granted: Duration,
    /// Renewals in flight, oldest first: answered in that order.
    in_flight: VecDeque<JoinHandle<std::result::Result<(), zk::Error>>>,
    /// The session has expired at the server.
    gone: bool,
    on_grant: Option<tokio::sync::oneshot::Sender<(i64, Weak<zk::Client>)>>,
}

impl ZkLeaseTransport {
    pub(super) fn new(
        hosts: String,
        config: &ElectionConfig,
        stats: Arc<Stats>,
        on_grant: tokio::sync::oneshot::Sender<(i64, Weak<zk::Client>)>,
    ) -> ZkLeaseTransport {
        ZkLeaseTransport {
            hosts,
            config: config.clone(),
            stats,
            client: None,
            granted: Duration::ZERO,
            in_flight: VecDeque::new(),
            gone: false,
            on_grant: Some(on_grant),
        }
    }

    /// Forgets every renewal in flight: the lease driver forgets them on a failure, and an
    /// answer must never be matched to a later send.
    fn abort_in_flight(&mut self) {
        for renewal in self.in_flight.drain(..) {
            renewal.abort();
        }
    }
}

impl Drop for ZkLeaseTransport {
    fn drop(&mut self) {
        self.abort_in_flight();
    }
}

impl LeaseTransport for ZkLeaseTransport {
    async fn grant(&mut self, ttl: Duration) -> Result<Duration> {
        self.stats.request();
        let connect = zk::Client::connector()
            .with_session_timeout(ttl)
            .with_detached()
            .with_fail_eagerly()
            .connect(&self.hosts);
        let client = bounded(REQUEST_TIMEOUT, "lease grant", connect)
            .await?
            .map_err(|error| zk_error("lease grant", error))?;
        let negotiated = client.session_timeout();
        if negotiated > ttl {
            // Rule 1 promises that a holder's place is free within the TTL; this server would
            // keep the session longer. Refuse, as bad configuration.
            let _ = close_session(&self.hosts, Arc::new(client)).await;
            return Err(Error::Config(ConfigError::TtlBelowMinimum {
                ttl: format_duration(ttl),
                minimum: format_duration(negotiated),
            }));
        }
        if self.config.local_lease(negotiated) <= self.config.renew_interval() {
            // The server cut the TTL below what the renew interval can keep alive.
            let _ = close_session(&self.hosts, Arc::new(client)).await;
            return Err(Error::Config(ConfigError::TtlAboveMaximum {
                ttl: format_duration(ttl),
                maximum: format_duration(negotiated),
            }));
        }
        let client = Arc::new(client);
        self.granted = negotiated;
        if let Some(tx) = self.on_grant.take() {
            let _ = tx.send((client.session_id().0, Arc::downgrade(&client)));
        }
        self.client = Some(client);
        Ok(negotiated)
    }

    async fn send_renewal(&mut self) -> Result<()> {
        if self.gone {
            // `next_renewal` says so.
            return Ok(());
        }
        let Some(client) = self.client.as_deref() else {
            return Err(Error::Closed);
        };
        self.stats.renewals.fetch_add(1, Ordering::Relaxed);
        let client = client.clone();
        let limit = self.granted;
        // Sent from its own task (the library's request future borrows its client); it goes
        // out when the task first runs, a moment after the send time the lease driver took,
        // which only makes the deadline earlier.
        self.in_flight.push_back(tokio::spawn(async move {
            match tokio::time::timeout(limit, client.sync("/")).await {
                Ok(answer) => answer,
                Err(_) => Err(zk::Error::Timeout),
            }
        }));
        Ok(())
    }

    fn reopen(&mut self) {
        // The session's connection is the client's to replace; what is in flight is forgotten.
        self.abort_in_flight();
    }

    async fn next_renewal(&mut self) -> Result<Duration> {
        if self.gone {
            return Ok(Duration::ZERO);
        }
        let Some(oldest) = self.in_flight.front_mut() else {
            return std::future::pending().await;
        };
        let answer = oldest.await;
        self.in_flight.pop_front();
        match answer {
            Ok(Ok(())) => Ok(self.granted),
            Ok(Err(
                zk::Error::SessionExpired | zk::Error::ClientClosed | zk::Error::AuthFailed,
            )) => {
                self.gone = true;
                self.abort_in_flight();
                Ok(Duration::ZERO)
            }
            Ok(Err(error)) => {
                self.abort_in_flight();
                Err(zk_error("lease renewal", error))
            }
            Err(_) => {
                self.abort_in_flight();
                Err(Error::Closed)
            }
        }
    }

    async fn revoke(&mut self) -> Result<()> {
        self.abort_in_flight();
        let Some(client) = self.client.take() else {
            return Ok(());
        };
        if self.gone {
            return Ok(());
        }
        self.stats.request();
        close_session(&self.hosts, client).await
    }
}

/// Closes the session of the detached `client` at the server: attaches to it once more with a
/// client that closes its session when dropped, drops it, and waits until the close is done.
async fn close_session(hosts: &str, client: Arc<zk::Client>) -> Result<()> {
    let session = client.session().clone();
    let timeout = client.session_timeout();
    // Detached: its connection closes, its session stays.
    drop(client);
    let attach = zk::Client::connector()
        .with_session(session)
        .with_session_timeout(timeout)
        .with_fail_eagerly()
        .connect(hosts);
    let closer = match bounded(REQUEST_TIMEOUT, "lease revoke", attach).await? {
        Ok(closer) => closer,
        // Gone already.
        Err(zk::Error::SessionExpired) => return Ok(()),
        Err(error) => return Err(zk_error("lease revoke", error)),
    };
    let mut states = closer.state_watcher();
    drop(closer);
    bounded(REQUEST_TIMEOUT, "lease revoke", async {
        while !states.peek_state().is_terminated() {
            states.changed().await;
        }
    })
    .await
}

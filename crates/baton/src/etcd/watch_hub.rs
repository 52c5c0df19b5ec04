//! One etcd watch stream per backend, shared by every candidate's deletion watches.
//!
//! A candidate only ever waits for one deletion at a time per key (its own key, its
//! predecessor's): the first deletion after the start revision is the one it cares about, so
//! each watch fires at most once, then is cancelled at the server. Multiplexing them over one
//! gRPC stream keeps memory and server-side streams flat as the number of elections grows.
//!
//! With several endpoints the stream is pinned to one that answers; once that one stops
//! answering its checks the stream is given up and every watch on it fires
//! [`Fired::Broken`] (its candidate looks again and watches anew, on another endpoint): a
//! member that hangs would otherwise keep a waiting candidate deaf to the deletion it waits
//! for. The checks find a hung member only once one has waited 2 s for it (up to 4 s after the
//! hang), so the hub also asks the stream's member a count-only read every [`PROBE`]
//! (serializable: answered from the member's own store, so a leader election elsewhere does not
//! count against it) and gives the stream up when one goes unanswered for [`PROBE`]: a waiter
//! hears of a handoff about 2-3 s after its member hung (the probe's 1-2 s, then a look at the
//! queue and a new watch on another member). Opening the stream is bounded the same way.

use std::collections::HashMap;
use std::sync::atomic::{AtomicI64, Ordering};
use std::sync::Arc;

use super::client::{
    Client, EventType, GetOptions, Pin, WatchFilterType, WatchOptions, WatchRequestSender,
    WatchResponse, WatchResponseStream,
};
use tokio::sync::{mpsc, oneshot};

use crate::error::{Error, Result};
use crate::etcd::MEMBER_PROBE as PROBE;
use crate::stats::Stats;

/// Bound on queued registrations and cancellations: one or two per candidate at a time.
const QUEUE: usize = 1024;

/// Why a deletion watch fired: the entry is the key.
pub(crate) type Fired = crate::driver::Fired<Vec<u8>>;

/// baton server's queue check on a predecessor's deletion watch (see
/// [`WatchOptions::with_queue_check`]).
#[derive(Debug, Clone)]
pub(crate) struct QueueCheck {
    pub(crate) own_key: Vec<u8>,
    pub(crate) own_create_revision: i64,
    /// The election's candidates prefix.
    pub(crate) scope: Vec<u8>,
}

enum Request {
    Watch {
        id: i64,
        key: Vec<u8>,
        start_revision: i64,
        check: Option<QueueCheck>,
        fired: oneshot::Sender<Fired>,
    },
    Cancel {
        id: i64,
    },
}

/// The shared stream's handle.
pub(crate) struct WatchHub {
    requests: mpsc::Sender<Request>,
    next_id: AtomicI64,
}

/// One registered deletion watch; cancelled at the server when dropped.
pub(crate) struct DeletionWatch {
    id: i64,
    receiver: Option<oneshot::Receiver<Fired>>,
    requests: mpsc::Sender<Request>,
}

impl DeletionWatch {
    /// Resolves once, when the key is deleted or the watch breaks; pends forever after that.
    /// Cancel-safe.
    pub(crate) async fn fired(&mut self) -> Fired {
        let Some(receiver) = self.receiver.as_mut() else {
            return std::future::pending().await;
        };
        let fired = receiver.await.unwrap_or(Fired::Broken);
        self.receiver = None;
        fired
    }
}

impl Drop for DeletionWatch {
    fn drop(&mut self) {
        // If the queue is full the hub still drops the watch when it fires.
        let _ = self.requests.try_send(Request::Cancel { id: self.id });
    }
}

impl WatchHub {
    /// A hub for `client`; its task ends when the hub is dropped.
    pub(crate) fn new(client: Client, stats: Arc<Stats>) -> WatchHub {
        let (requests, requests_rx) = mpsc::channel(QUEUE);
        tokio::spawn(run(client, stats, requests_rx));
        WatchHub {
            requests,
            // Watch ids are ours to choose (etcd 3.4+); zero would ask the server to choose.
            next_id: AtomicI64::new(1),
        }
    }

    /// Watches for the first deletion of `key` at or after `start_revision`. With a `check`,
    /// baton server says with the deletion whether our own entry is then first; if it does,
    /// the watch fires [`Fired::DeletedFirst`].
    pub(crate) async fn watch(
        &self,
        key: Vec<u8>,
        start_revision: i64,
        check: Option<QueueCheck>,
    ) -> Result<DeletionWatch> {
        let id = self.next_id.fetch_add(1, Ordering::Relaxed);
        let (fired, receiver) = oneshot::channel();
        let request = Request::Watch {
            id,
            key,
            start_revision,
            check,
            fired,
        };
        self.requests
            .send(request)
            .await
            .map_err(|_| Error::Closed)?;
        Ok(DeletionWatch {
            id,
            receiver: Some(receiver),
            requests: self.requests.clone(),
        })
    }
}

async fn run(client: Client, stats: Arc<Stats>, mut requests: mpsc::Receiver<Request>) {
    let mut hub = Hub {
        client,
        stats,
        stream: None,
        endpoint: None,
        avoid: None,
        member: None,
        probe: None,
        watches: HashMap::new(),
    };
    loop {
        tokio::select! {
            request = requests.recv() => match request {
                Some(request) => hub.handle_request(request).await,
                None => return,
            },
            _ = hub.client.left(hub.endpoint), if hub.stream.is_some() => hub.break_all(),
            () = unanswered(&mut hub.probe) => {
                crate::metrics::backend_error("watch");
                hub.break_all();
            }
            message = next_message(&mut hub.stream) => match message {
                Ok(Some(response)) => hub.handle_response(response).await,
                Ok(None) => hub.break_all(),
                Err(_) => {
                    crate::metrics::backend_error("watch");
                    hub.break_all();
                }
            },
        }
        hub.tend_probe();
    }
}

async fn next_message(
    stream: &mut Option<(WatchRequestSender, WatchResponseStream)>,
) -> std::result::Result<Option<WatchResponse>, super::client::Error> {
    match stream.as_mut() {
        Some((_, responses)) => responses.message().await,
        None => std::future::pending().await,
    }
}

/// Resolves once the probe of the stream's member went unanswered; never without a probe.
async fn unanswered(probe: &mut Option<Probe>) {
    match probe.as_mut() {
        // A probe that ended without a word (it cannot, but for a panic) counts as unanswered.
        Some(probe) => {
            let _ = (&mut probe.unanswered).await;
        }
        None => std::future::pending().await,
    }
}

/// The task that asks the stream's member a read every [`PROBE`]; it ends with this value.
struct Probe {
    task: tokio::task::JoinHandle<()>,
    unanswered: oneshot::Receiver<()>,
}

impl Probe {
    fn start(mut client: Client, stats: Arc<Stats>) -> Probe {
        let (tell, unanswered) = oneshot::channel();
        let task = tokio::spawn(async move {
            let mut every = tokio::time::interval(PROBE);
            every.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
            every.tick().await;
            loop {
                every.tick().await;
                stats.request();
                // Serializable: the member answers from its own store. A linearizable read
                // would wait for the Raft leader, and an etcd leader election (1-2 s) would
                // then break every stream of every candidate at once.
                let options = GetOptions::new().with_count_only().with_serializable();
                let ask = client.get(b"\0".to_vec(), Some(options));
                if !matches!(tokio::time::timeout(PROBE, ask).await, Ok(Ok(_))) {
                    let _ = tell.send(());
                    return;
                }
            }
        });
        Probe { task, unanswered }
    }
}

impl Drop for Probe {
    fn drop(&mut self) {
        self.task.abort();
    }
}

struct Hub {
    client: Client,
    stats: Arc<Stats>,
    stream: Option<(WatchRequestSender, WatchResponseStream)>,
    /// The endpoint the stream is pinned to (with several).
    endpoint: Option<Pin>,
    /// The endpoint of the last stream given up: the next one goes elsewhere.
    avoid: Option<usize>,
    /// With several endpoints, a client of the stream's member only.
    member: Option<Client>,
    /// Its probe, while some watch is registered.
    probe: Option<Probe>,
    /// Each watch's channel, and whether it asked for the queue check.
    watches: HashMap<i64, (oneshot::Sender<Fired>, bool)>,
}

impl Hub {
    async fn handle_request(&mut self, request: Request) {
        match request {
            Request::Watch {
                id,
                key,
                start_revision,
                check,
                fired,
            } => {
                if fired.is_closed() {
                    return;
                }
                let mut options = WatchOptions::new()
                    .with_watch_id(id)
                    .with_filters([WatchFilterType::NoPut])
                    .with_prev_key()
                    .with_start_revision(start_revision);
                let checked = check.is_some();
                if let Some(check) = check {
                    options = options.with_queue_check(
                        check.own_key,
                        check.own_create_revision,
                        check.scope,
                    );
                }
                self.stats.request();
                if self.create(key, options).await {
                    self.watches.insert(id, (fired, checked));
                } else {
                    let _ = fired.send(Fired::Broken);
                }
            }
            Request::Cancel { id } => {
                if self.watches.remove(&id).is_some() {
                    self.cancel_at_server(id).await;
                }
            }
        }
    }

    /// Registers a watch, opening the stream if needed. Returns whether it worked.
    async fn create(&mut self, key: Vec<u8>, options: WatchOptions) -> bool {
        if let Some((sender, _)) = self.stream.as_mut() {
            if sender.watch(key, Some(options)).await.is_ok() {
                return true;
            }
            crate::metrics::backend_error("watch");
            self.break_all();
            return false;
        }
        let (mut client, endpoint) = self
            .client
            .pinned_elsewhere(self.avoid, crate::etcd::ELSEWHERE_WAIT)
            .await;
        // With one endpoint there is nowhere else to go: the request timeout. With several,
        // a member that hangs just now must not hold every registration for that long.
        let limit = match endpoint {
            Some(_) => PROBE,
            None => crate::etcd::REQUEST_TIMEOUT,
        };
        let open = client.watch(key, Some(options));
        match tokio::time::timeout(limit, open).await {
            Ok(Ok(stream)) => {
                self.stream = Some(stream.split());
                self.member = endpoint.map(|_| client);
                self.endpoint = endpoint;
                true
            }
            _ => {
                // The next try goes elsewhere.
                self.avoid = endpoint.map(|pin| pin.index);
                crate::metrics::backend_error("watch");
                false
            }
        }
    }

    async fn cancel_at_server(&mut self, id: i64) {
        if let Some((sender, _)) = self.stream.as_mut() {
            let _ = sender.cancel(id).await;
        }
    }

    async fn handle_response(&mut self, response: WatchResponse) {
        let id = response.watch_id();
        if response.canceled() {
            // The server gave up on this watch (say, its start revision was compacted).
            if let Some((fired, _)) = self.watches.remove(&id) {
                let _ = fired.send(Fired::Broken);
            }
            return;
        }
        for event in response.events() {
            self.stats.watch_events.fetch_add(1, Ordering::Relaxed);
            if event.event_type() != EventType::Delete {
                continue;
            }
            let Some((fired, checked)) = self.watches.remove(&id) else {
                return;
            };
            let outcome = match (event.kv(), event.prev_kv()) {
                // Only a watch that asked for the check takes the server's word for it.
                (Some(kv), Some(prev)) => {
                    let entry = kv.key().to_vec();
                    let position = super::queue::position(prev.create_revision());
                    match response.first_at().filter(|_| checked) {
                        Some(at) => Fired::DeletedFirst {
                            entry,
                            position,
                            at: crate::driver::ReadPoint(u64::try_from(at).unwrap_or(0)),
                        },
                        None => Fired::Deleted { entry, position },
                    }
                }
                // Without the previous value we cannot tell which incarnation went.
                _ => Fired::Broken,
            };
            let _ = fired.send(outcome);
            self.cancel_at_server(id).await;
            return;
        }
    }

    /// Probes the stream's member exactly while some watch waits on it (an idle stream costs
    /// no requests).
    fn tend_probe(&mut self) {
        let wanted = self.stream.is_some() && !self.watches.is_empty();
        match (&self.member, wanted) {
            (Some(member), true) if self.probe.is_none() => {
                self.probe = Some(Probe::start(member.clone(), self.stats.clone()));
            }
            (_, false) => self.probe = None,
            _ => {}
        }
    }

    /// The stream is gone: every watch on it is broken.
    fn break_all(&mut self) {
        self.probe = None;
        self.member = None;
        if self.stream.take().is_some() {
            self.avoid = self.endpoint.take().map(|pin| pin.index);
        }
        for (_, (fired, _)) in self.watches.drain() {
            let _ = fired.send(Fired::Broken);
        }
    }
}

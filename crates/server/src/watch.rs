//! Watchers and where their events go.
//!
//! The hub lives inside the shared core, under the same lock as the store: the state machine
//! hands it every applied event before the lock is released, and a new watch reads its history
//! and registers for live events under that lock too, so no revision is missed or seen twice.
//!
//! Each gRPC watch stream has one outgoing queue (a [`StreamSink`]). The queue is bounded by
//! count and by bytes: a watcher whose stream has more than [`MAX_QUEUED`] responses, or more
//! than [`MAX_QUEUED_BYTES`], waiting (a client that stopped reading) is cancelled with a
//! reason instead of growing the server's memory.

use std::collections::{HashMap, HashSet};
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::Arc;

use prost::Message as _;
use tokio::sync::mpsc;

use crate::proto::etcdserverpb::{QueueCheck, ResponseHeader, WatchResponse};
use crate::proto::mvccpb::{event::EventType, Event};
use crate::store::{in_range, Store, StoreError};

/// Responses a stream may have waiting before its watchers are cancelled as too slow.
pub const MAX_QUEUED: usize = 10_000;
/// Bytes of responses a stream may have waiting (large values fill memory before the count).
pub const MAX_QUEUED_BYTES: usize = 64 * 1024 * 1024;

/// The outgoing side of one watch stream.
#[derive(Clone)]
pub struct StreamSink {
    tx: mpsc::UnboundedSender<WatchResponse>,
    queued: Arc<AtomicUsize>,
    queued_bytes: Arc<AtomicUsize>,
}

/// The receiving side of a [`StreamSink`]: the gRPC response stream drains it.
pub struct StreamSource {
    rx: mpsc::UnboundedReceiver<WatchResponse>,
    queued: Arc<AtomicUsize>,
    queued_bytes: Arc<AtomicUsize>,
}

/// A new stream's queue.
pub fn stream_queue() -> (StreamSink, StreamSource) {
    let (tx, rx) = mpsc::unbounded_channel();
    let queued = Arc::new(AtomicUsize::new(0));
    let queued_bytes = Arc::new(AtomicUsize::new(0));
    (
        StreamSink {
            tx,
            queued: queued.clone(),
            queued_bytes: queued_bytes.clone(),
        },
        StreamSource {
            rx,
            queued,
            queued_bytes,
        },
    )
}

impl StreamSink {
    /// Queues a response; false when the stream is gone.
    pub fn send(&self, response: WatchResponse) -> bool {
        self.queued.fetch_add(1, Ordering::Relaxed);
        self.queued_bytes
            .fetch_add(response.encoded_len(), Ordering::Relaxed);
        self.tx.send(response).is_ok()
    }

    fn overloaded(&self) -> bool {
        self.queued.load(Ordering::Relaxed) > MAX_QUEUED
            || self.queued_bytes.load(Ordering::Relaxed) > MAX_QUEUED_BYTES
    }
}

impl StreamSource {
    /// The next response to write.
    pub async fn next(&mut self) -> Option<WatchResponse> {
        let response = self.rx.recv().await?;
        self.queued.fetch_sub(1, Ordering::Relaxed);
        self.queued_bytes
            .fetch_sub(response.encoded_len(), Ordering::Relaxed);
        Some(response)
    }
}

/// Identifies a watcher: its stream and its watch id within the stream.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub struct WatcherId {
    /// The gRPC stream.
    pub stream: u64,
    /// The watch id the client sees.
    pub watch: i64,
}

/// One watch.
pub struct Watcher {
    /// First key.
    pub key: Vec<u8>,
    /// etcd range end (empty: the single key).
    pub range_end: Vec<u8>,
    /// Events before this revision were delivered from history (or not asked for).
    pub start_revision: i64,
    /// Whether events carry the previous key-value.
    pub prev_kv: bool,
    /// Leave out PUT events.
    pub no_put: bool,
    /// Leave out DELETE events.
    pub no_delete: bool,
    /// Whether the client wants progress notifications.
    pub progress_notify: bool,
    /// Whether an event was sent since the last progress notification.
    pub sent_since_progress: bool,
    /// Where its responses go.
    pub sink: StreamSink,
    /// baton's extension: on a deletion, tell the client whether its own entry is now first.
    pub queue_check: Option<QueueCheck>,
}

impl Watcher {
    /// The events of `events` this watcher wants, as it wants them.
    pub fn select(&self, events: &[Event]) -> Vec<Event> {
        events
            .iter()
            .filter(|event| {
                let kv = event.kv.as_ref();
                let revision = kv.map_or(0, |kv| kv.mod_revision);
                let key = kv.map_or(&[][..], |kv| kv.key.as_slice());
                let wanted = match EventType::try_from(event.r#type) {
                    Ok(EventType::Put) => !self.no_put,
                    Ok(EventType::Delete) => !self.no_delete,
                    Err(_) => false,
                };
                wanted
                    && revision >= self.start_revision
                    && in_range(&self.key, &self.range_end, key)
            })
            .map(|event| {
                let mut event = event.clone();
                if !self.prev_kv {
                    event.prev_kv = None;
                }
                event
            })
            .collect()
    }

    /// The revision to put in `baton_first_at` of a response carrying `events`: the store's,
    /// when the watcher asked for the queue check, one of the events is a deletion, and the
    /// check holds in `store` (which has applied everything up to the response's revision).
    /// `oldest` remembers each scope's oldest create revision for the other watchers told of
    /// the same revision (a `del --prefix` of a queue costs one scan, not one per waiter).
    pub fn first_at(&self, store: &Store, events: &[Event], oldest: &mut ScopeOldest) -> i64 {
        let Some(check) = &self.queue_check else {
            return 0;
        };
        let deleted = events
            .iter()
            .any(|event| event.r#type == EventType::Delete as i32);
        if !deleted {
            return 0;
        }
        let scope = (check.scope_key.clone(), check.scope_range_end.clone());
        let oldest = *oldest
            .entry(scope)
            .or_insert_with(|| store.oldest_in(&check.scope_key, &check.scope_range_end));
        if store.is_first(&check.own_key, check.own_create_revision, oldest) {
            store.revision()
        } else {
            0
        }
    }

    fn exact_key(&self) -> Option<&[u8]> {
        self.range_end.is_empty().then_some(self.key.as_slice())
    }
}

/// Each queue scope's oldest create revision at one revision: see [`Watcher::first_at`].
pub type ScopeOldest = HashMap<(Vec<u8>, Vec<u8>), Option<i64>>;

/// Every watcher of the server, indexed by key for single-key watches.
#[derive(Default)]
pub struct WatchHub {
    watchers: HashMap<WatcherId, Watcher>,
    /// Single-key watchers by key: most watches (a waiter's predecessor) are on one key.
    by_key: HashMap<Vec<u8>, HashSet<WatcherId>>,
    /// Prefix and range watchers, matched one by one.
    ranged: HashSet<WatcherId>,
}

impl WatchHub {
    /// Whether `id` is in use.
    pub fn contains(&self, id: WatcherId) -> bool {
        self.watchers.contains_key(&id)
    }

    /// How many watchers there are.
    pub fn len(&self) -> usize {
        self.watchers.len()
    }

    /// Whether there is no watcher.
    pub fn is_empty(&self) -> bool {
        self.watchers.is_empty()
    }

    /// Adds a watcher that already got its history.
    pub fn insert(&mut self, id: WatcherId, watcher: Watcher) {
        match watcher.exact_key() {
            Some(key) => {
                self.by_key.entry(key.to_vec()).or_default().insert(id);
            }
            None => {
                self.ranged.insert(id);
            }
        }
        self.watchers.insert(id, watcher);
    }

    /// Removes a watcher; false when there was none.
    pub fn remove(&mut self, id: WatcherId) -> bool {
        let Some(watcher) = self.watchers.remove(&id) else {
            return false;
        };
        match watcher.exact_key() {
            Some(key) => {
                if let Some(ids) = self.by_key.get_mut(key) {
                    ids.remove(&id);
                    if ids.is_empty() {
                        self.by_key.remove(key);
                    }
                }
            }
            None => {
                self.ranged.remove(&id);
            }
        }
        true
    }

    /// Removes every watcher of a stream (it ended).
    pub fn remove_stream(&mut self, stream: u64) {
        let ids: Vec<WatcherId> = self
            .watchers
            .keys()
            .filter(|id| id.stream == stream)
            .copied()
            .collect();
        for id in ids {
            self.remove(id);
        }
    }

    /// The watchers of one stream that asked for progress notifications and got no event since
    /// the last one; marks them as notified.
    pub fn take_idle_progress(&mut self, stream: u64) -> Vec<i64> {
        let mut idle = Vec::new();
        for (id, watcher) in &mut self.watchers {
            if id.stream == stream && watcher.progress_notify {
                if !watcher.sent_since_progress {
                    idle.push(id.watch);
                }
                watcher.sent_since_progress = false;
            }
        }
        idle
    }

    /// Tells every interested watcher about the events of one revision; `store` has just
    /// applied them (for the queue check).
    pub fn dispatch(&mut self, header: &ResponseHeader, events: &[Event], store: &Store) {
        // Range watchers, then single-key watchers of the keys these events touch; a watcher
        // appears once (a single-key watcher is never a range watcher).
        let mut interested: Vec<WatcherId> = self.ranged.iter().copied().collect();
        let mut keys: Vec<&[u8]> = events
            .iter()
            .filter_map(|event| event.kv.as_ref().map(|kv| kv.key.as_slice()))
            .collect();
        keys.sort_unstable();
        keys.dedup();
        for key in keys {
            if let Some(ids) = self.by_key.get(key) {
                interested.extend(ids.iter().copied());
            }
        }
        let mut gone = Vec::new();
        let mut oldest = ScopeOldest::new();
        for id in interested {
            let Some(watcher) = self.watchers.get_mut(&id) else {
                continue;
            };
            let selected = watcher.select(events);
            if selected.is_empty() {
                continue;
            }
            if watcher.sink.overloaded() {
                watcher.sink.send(cancelled(
                    header,
                    id.watch,
                    "etcdserver: watcher is too slow: it left too many responses unread",
                ));
                gone.push(id);
                continue;
            }
            watcher.sent_since_progress = true;
            let response = WatchResponse {
                header: Some(*header),
                watch_id: id.watch,
                baton_first_at: watcher.first_at(store, &selected, &mut oldest),
                events: selected,
                ..WatchResponse::default()
            };
            if !watcher.sink.send(response) {
                gone.push(id);
            }
        }
        for id in gone {
            self.remove(id);
        }
    }

    /// Cancels every watcher, telling each why.
    pub fn cancel_all(&mut self, reason: &str) {
        let header = ResponseHeader::default();
        for (id, watcher) in self.watchers.drain() {
            watcher.sink.send(cancelled(&header, id.watch, reason));
        }
        self.by_key.clear();
        self.ranged.clear();
    }
}

/// etcd's answer to a watch it refuses (an empty range, an id in use): created and cancelled
/// at once, under watch id -1.
pub fn refused(header: &ResponseHeader, reason: &str) -> WatchResponse {
    WatchResponse {
        created: true,
        ..cancelled(header, -1, reason)
    }
}

/// A watch cancelled because the history it asked for is gone.
pub fn compacted(header: &ResponseHeader, watch_id: i64, compact_revision: i64) -> WatchResponse {
    WatchResponse {
        compact_revision,
        ..cancelled(
            header,
            watch_id,
            &StoreError::Compacted { compact_revision }.to_string(),
        )
    }
}

/// A response cancelling watch `watch_id`.
pub fn cancelled(header: &ResponseHeader, watch_id: i64, reason: &str) -> WatchResponse {
    WatchResponse {
        header: Some(*header),
        watch_id,
        canceled: true,
        cancel_reason: reason.to_string(),
        ..WatchResponse::default()
    }
}

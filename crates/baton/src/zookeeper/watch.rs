//! Deletion watches: an exists-watch on one entry's znode.
//!
//! ZooKeeper cannot replay history, and it need not: an entry's name carries its sequence
//! number, so it names one incarnation, which existed at the caller's read point. If the
//! exists-watch finds it gone, it was deleted after that point: that deletion fires at once.
//! If it finds it, the watch is registered by that same request, so no later deletion is missed.
//! A lost connection or an ended session fires `Broken` (the driver finds out afresh where it
//! stands), rather than trusting the library to replay what happened meanwhile.

use std::sync::atomic::Ordering;
use std::sync::Arc;

use tokio::sync::oneshot;
use tokio::task::JoinHandle;
use zookeeper_client as zk;

use super::queue::ZkEntry;
use super::{ask, disconnected, request, REQUEST_TIMEOUT};
use crate::driver::{EntryWatch, Fired, Position};
use crate::error::Result;
use crate::stats::Stats;

/// One deletion watch; dropping it cancels it.
pub(crate) struct ZkWatch {
    fired: Option<oneshot::Receiver<Fired<ZkEntry>>>,
    task: Option<JoinHandle<()>>,
    /// The watching backend's counters: a deletion it hears of is a watch event.
    stats: Arc<Stats>,
}

impl ZkWatch {
    /// Watches for the deletion of `entry`, the znode at `path` created at czxid `position`.
    pub(super) async fn start(
        client: zk::Client,
        stats: Arc<Stats>,
        entry: ZkEntry,
        path: String,
        position: u64,
    ) -> Result<ZkWatch> {
        // Taken before the request, so a disconnection right after it is seen.
        let states = client.state_watcher();
        let (stat, change) =
            request(&stats, "watch entry", client.check_and_watch_stat(&path)).await?;
        let (tx, fired) = oneshot::channel();
        let deleted = Fired::Deleted {
            entry,
            position: Position(position),
        };
        if stat.is_none_or(|stat| stat.czxid as u64 != position) {
            let _ = tx.send(deleted);
            return Ok(ZkWatch {
                fired: Some(fired),
                task: None,
                stats,
            });
        }
        let task = tokio::spawn(follow(
            client,
            stats.clone(),
            states,
            change,
            path,
            position,
            deleted,
            tx,
        ));
        Ok(ZkWatch {
            fired: Some(fired),
            task: Some(task),
            stats,
        })
    }
}

/// Waits for the watch to fire, and watches again after a change that is not a deletion (the
/// entry's holder writes its data in fenced transactions).
#[allow(clippy::too_many_arguments)]
async fn follow(
    client: zk::Client,
    stats: Arc<Stats>,
    mut states: zk::StateWatcher,
    change: zk::OneshotWatcher,
    path: String,
    position: u64,
    deleted: Fired<ZkEntry>,
    tx: oneshot::Sender<Fired<ZkEntry>>,
) {
    let mut change = Box::pin(change.changed());
    let outcome = loop {
        tokio::select! {
            event = &mut change => match event.event_type {
                zk::EventType::NodeDeleted => break deleted,
                zk::EventType::Session => break Fired::Broken,
                _ => {
                    let again = ask(
                        &stats,
                        REQUEST_TIMEOUT,
                        "watch entry",
                        client.check_and_watch_stat(&path),
                    )
                    .await;
                    match again {
                        Ok(Ok((Some(stat), next))) if stat.czxid as u64 == position => {
                            change = Box::pin(next.changed());
                        }
                        Ok(Ok(_)) => break deleted,
                        _ => break Fired::Broken,
                    }
                }
            },
            _ = disconnected(&mut states) => break Fired::Broken,
        }
    };
    let _ = tx.send(outcome);
}

impl EntryWatch<ZkEntry> for ZkWatch {
    async fn fired(&mut self) -> Fired<ZkEntry> {
        let Some(receiver) = self.fired.as_mut() else {
            return std::future::pending().await;
        };
        let fired = receiver.await.unwrap_or(Fired::Broken);
        self.fired = None;
        if matches!(fired, Fired::Deleted { .. }) {
            self.stats.watch_events.fetch_add(1, Ordering::Relaxed);
        }
        fired
    }
}

impl Drop for ZkWatch {
    fn drop(&mut self) {
        if let Some(task) = self.task.take() {
            task.abort();
        }
    }
}

//! Lease deadlines, kept by the member that leads the Raft group.
//!
//! Which leases exist, with which TTL and keys, is replicated state (the store). When each one
//! runs out is not: like etcd, only the leader times leases, keep-alives reset its timers
//! without going through the log, and an expiry becomes a `LeaseRevoke` entry that every member
//! applies. A member that becomes leader, or starts again, gives every lease a full TTL, so a
//! live holder is never expired early by a restart.
//!
//! Timers are exact: the expiry task sleeps until the earliest deadline, not until a coarse
//! tick, so a lease is revoked within the time of one log write after its TTL.
//!
//! Once a deadline has passed, the lease is taken out of the timers before its revoke is
//! proposed: a keep-alive arriving in between is answered with TTL 0 (expired), never with a
//! renewal the revoke would then contradict.

use std::collections::{BTreeSet, HashMap};
use std::sync::{Mutex, MutexGuard};
use std::time::Duration;

use tokio::sync::Notify;
use tokio::time::Instant;

/// The leader's lease timers.
#[derive(Default)]
pub struct LeaseKeeper {
    timers: Mutex<Timers>,
    /// Woken when the earliest deadline may have moved earlier.
    changed: Notify,
}

#[derive(Default)]
struct Timers {
    /// Lease id → (deadline, TTL in seconds).
    leases: HashMap<i64, (Instant, i64)>,
    /// The same deadlines, ordered.
    order: BTreeSet<(Instant, i64)>,
}

impl Timers {
    fn set(&mut self, id: i64, deadline: Instant, ttl_seconds: i64) {
        if let Some((old, _)) = self.leases.insert(id, (deadline, ttl_seconds)) {
            self.order.remove(&(old, id));
        }
        self.order.insert((deadline, id));
    }

    fn remove(&mut self, id: i64) {
        if let Some((deadline, _)) = self.leases.remove(&id) {
            self.order.remove(&(deadline, id));
        }
    }
}

fn ttl(ttl_seconds: i64) -> Duration {
    Duration::from_secs(u64::try_from(ttl_seconds).unwrap_or(0))
}

impl LeaseKeeper {
    fn timers(&self) -> MutexGuard<'_, Timers> {
        self.timers.lock().unwrap_or_else(|e| e.into_inner())
    }

    /// A lease was granted (applied): its TTL starts now.
    pub fn granted(&self, id: i64, ttl_seconds: i64) {
        let deadline = Instant::now() + ttl(ttl_seconds);
        self.timers().set(id, deadline, ttl_seconds);
        self.changed.notify_one();
    }

    /// A lease was revoked or expired (applied).
    pub fn revoked(&self, id: i64) {
        self.timers().remove(id);
    }

    /// Every lease gets a full TTL from now: at start-up, after a snapshot was installed, and
    /// when this member becomes leader.
    pub fn reset_all(&self, leases: &[(i64, i64)]) {
        let now = Instant::now();
        let mut timers = self.timers();
        *timers = Timers::default();
        for &(id, ttl_seconds) in leases {
            timers.set(id, now + ttl(ttl_seconds), ttl_seconds);
        }
        drop(timers);
        self.changed.notify_one();
    }

    /// A keep-alive: the TTL starts again now. `None` when the lease is unknown or has already
    /// run out (its revoke may still be on its way through the log).
    pub fn keep_alive(&self, id: i64) -> Option<i64> {
        let mut timers = self.timers();
        let (_, ttl_seconds) = *timers.leases.get(&id)?;
        timers.set(id, Instant::now() + ttl(ttl_seconds), ttl_seconds);
        Some(ttl_seconds)
    }

    /// Time left before the lease runs out, if it is timed here.
    pub fn remaining(&self, id: i64) -> Option<Duration> {
        let timers = self.timers();
        let (deadline, _) = timers.leases.get(&id)?;
        Some(deadline.saturating_duration_since(Instant::now()))
    }

    /// How many leases are timed.
    pub fn len(&self) -> usize {
        self.timers().leases.len()
    }

    /// Whether no lease is timed.
    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }

    /// Takes out every lease whose deadline has passed; the caller proposes their revokes.
    fn take_expired(&self, now: Instant) -> Vec<i64> {
        let mut timers = self.timers();
        let mut expired = Vec::new();
        while let Some(&(deadline, id)) = timers.order.first() {
            if deadline > now {
                break;
            }
            timers.order.pop_first();
            timers.leases.remove(&id);
            expired.push(id);
        }
        expired
    }

    fn next_deadline(&self) -> Option<Instant> {
        self.timers().order.first().map(|&(deadline, _)| deadline)
    }

    /// Runs the expiry timer for ever: sleeps until the earliest deadline, then hands every
    /// expired lease to `expire` (which proposes its revoke). `may_expire` says whether this
    /// member leads; a follower keeps its timers but never expires anything.
    pub async fn run<E, L>(&self, mut may_expire: L, mut expire: E)
    where
        E: FnMut(i64),
        L: FnMut() -> bool,
    {
        loop {
            let notified = self.changed.notified();
            tokio::pin!(notified);
            // Register for changes before reading the deadline, so none is missed in between.
            notified.as_mut().enable();
            match self.next_deadline() {
                Some(deadline) if deadline <= Instant::now() => {}
                Some(deadline) => {
                    tokio::select! {
                        () = tokio::time::sleep_until(deadline) => {}
                        () = &mut notified => continue,
                    }
                }
                None => {
                    notified.await;
                    continue;
                }
            }
            if !may_expire() {
                // Not the leader: look again shortly (leadership changes reset every timer).
                tokio::time::sleep(Duration::from_millis(100)).await;
                continue;
            }
            for id in self.take_expired(Instant::now()) {
                expire(id);
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[tokio::test(start_paused = true)]
    async fn a_lease_expires_at_its_ttl_and_keep_alives_push_it_back() {
        let keeper = std::sync::Arc::new(LeaseKeeper::default());
        let (tx, mut rx) = tokio::sync::mpsc::unbounded_channel();
        let runner = keeper.clone();
        let start = Instant::now();
        tokio::spawn(async move {
            runner
                .run(|| true, move |id| tx.send((id, Instant::now())).unwrap())
                .await
        });
        keeper.granted(7, 2);
        keeper.granted(8, 5);
        tokio::time::sleep(Duration::from_millis(1500)).await;
        assert_eq!(keeper.keep_alive(7), Some(2));
        let (id, at) = rx.recv().await.unwrap();
        assert_eq!(id, 7);
        assert_eq!(at - start, Duration::from_millis(3500));
        // Run out: a late keep-alive is refused, not renewed.
        assert_eq!(keeper.keep_alive(7), None);
        let (id, at) = rx.recv().await.unwrap();
        assert_eq!((id, at - start), (8, Duration::from_secs(5)));
        assert!(keeper.is_empty());
    }

    #[tokio::test(start_paused = true)]
    async fn reset_gives_every_lease_a_full_ttl_and_followers_never_expire() {
        let keeper = std::sync::Arc::new(LeaseKeeper::default());
        keeper.granted(1, 3);
        tokio::time::sleep(Duration::from_secs(2)).await;
        keeper.reset_all(&[(1, 3), (2, 1)]);
        assert_eq!(keeper.remaining(1), Some(Duration::from_secs(3)));
        let leading = std::sync::Arc::new(std::sync::atomic::AtomicBool::new(false));
        let (tx, mut rx) = tokio::sync::mpsc::unbounded_channel();
        let (runner, flag) = (keeper.clone(), leading.clone());
        tokio::spawn(async move {
            runner
                .run(
                    move || flag.load(std::sync::atomic::Ordering::SeqCst),
                    move |id| tx.send(id).unwrap(),
                )
                .await
        });
        tokio::time::sleep(Duration::from_secs(10)).await;
        assert!(rx.try_recv().is_err(), "a follower expired a lease");
        leading.store(true, std::sync::atomic::Ordering::SeqCst);
        let mut expired = vec![rx.recv().await.unwrap(), rx.recv().await.unwrap()];
        expired.sort();
        assert_eq!(expired, vec![1, 2]);
    }
}

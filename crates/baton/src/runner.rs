//! A callback-style runner on top of the `select!` loop, for those coming from client-go's
//! `leaderelection` (OnStartedLeading / OnStoppedLeading / OnNewLeader) or Curator's
//! `LeaderSelector`.
//!
//! ```
//! # #[tokio::main] async fn main() -> baton::Result<()> {
//! # let url = std::env::var("BATON_BACKEND").unwrap_or("etcd://127.0.0.1:2379/baton".into());
//! # let backend = baton::Backend::connect(&url).await?;
//! # let config = baton::ElectionConfig::default().with_ttl(std::time::Duration::from_secs(5));
//! # let election = baton::Election::new(&backend, "runner-doc", config)?;
//! use std::sync::Arc;
//! let runner = election
//!     .runner("host-a")
//!     .on_new_leader(|leader| println!("leader now: {leader:?}"))
//!     .on_stopped_leading(|why| eprintln!("stopped leading: {why:?}"));
//! runner
//!     .run(
//!         |leadership: Arc<baton::Leadership>| async move {
//!             // The job: runs while we lead, dropped (cancelled) the moment we stop.
//!             let _ = leadership.guarded_put("/jobs/cron/owner", "host-a").await;
//!             std::future::pending::<()>().await
//!         },
//!         // Your shutdown signal, such as `tokio::signal::ctrl_c()`.
//!         tokio::time::sleep(std::time::Duration::from_millis(200)),
//!     )
//!     .await
//! # }
//! ```

use std::future::Future;
use std::sync::Arc;

use baton_core::LossReason;

use crate::election::{CandidateOptions, Election, LeaderInfo, Leadership, Observed, Observer};
use crate::error::Result;

/// Why a term of office run by a [`Runner`] ended.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Stopped {
    /// Leadership was lost: the runner campaigns again.
    Lost(LossReason),
    /// The job's future completed: the runner resigns and returns.
    JobEnded,
    /// The shutdown future completed: the runner resigns and returns.
    Shutdown,
}

type NewLeader = Box<dyn FnMut(Option<&LeaderInfo>) + Send>;
type StoppedLeading = Box<dyn FnMut(Stopped) + Send>;

/// Runs a job while this candidate leads, campaigning again after each loss. Made by
/// [`Election::runner`].
pub struct Runner {
    election: Election,
    id: String,
    options: CandidateOptions,
    on_new_leader: Option<NewLeader>,
    on_stopped_leading: Option<StoppedLeading>,
}

impl std::fmt::Debug for Runner {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Runner")
            .field("election", &self.election.name())
            .field("id", &self.id)
            .finish_non_exhaustive()
    }
}

impl Runner {
    pub(crate) fn new(election: Election, id: String) -> Runner {
        Runner {
            election,
            id,
            options: CandidateOptions::default(),
            on_new_leader: None,
            on_stopped_leading: None,
        }
    }

    /// Campaigns with these options (a leader value, say).
    pub fn with_options(mut self, options: CandidateOptions) -> Runner {
        self.options = options;
        self
    }

    /// Called with every change of leader (ours included), `None` when there is none.
    pub fn on_new_leader(mut self, f: impl FnMut(Option<&LeaderInfo>) + Send + 'static) -> Runner {
        self.on_new_leader = Some(Box::new(f));
        self
    }

    /// Called when a term of office ends, after the job's future has been dropped.
    pub fn on_stopped_leading(mut self, f: impl FnMut(Stopped) + Send + 'static) -> Runner {
        self.on_stopped_leading = Some(Box::new(f));
        self
    }

    /// Campaigns; each time it is elected, runs `job(leadership)` until leadership is lost (the
    /// job's future is dropped at once, no later than the local deadline, and the runner
    /// campaigns again), the job completes, or `shutdown` completes (then it resigns and
    /// returns `Ok`). Fails if the candidacy fails for good (say
    /// [`crate::Error::TokenRegressed`]). Like any requeueing candidacy, one whose id another
    /// live candidate uses does not fail with [`crate::Error::DuplicateId`]: it keeps trying,
    /// with a warning, and campaigns once that candidate is gone.
    ///
    /// The job must stop acting when its future is dropped: work it spawns elsewhere should
    /// watch [`Leadership::lost`] itself.
    pub async fn run<F, Fut>(mut self, mut job: F, shutdown: impl Future<Output = ()>) -> Result<()>
    where
        F: FnMut(Arc<Leadership>) -> Fut,
        Fut: Future<Output = ()>,
    {
        let mut observer = match self.on_new_leader {
            Some(_) => Some(self.election.observe().await?),
            None => None,
        };
        let mut candidacy = self
            .election
            .start_candidacy(&self.id, self.options.clone(), true)?;
        tokio::pin!(shutdown);
        loop {
            let leadership = loop {
                tokio::select! {
                    biased;
                    _ = &mut shutdown => {
                        candidacy.resign().await;
                        return Ok(());
                    }
                    next = candidacy.next() => break Arc::new(next?),
                    Some(seen) = next_observed(&mut observer) => self.tell(seen),
                }
            };
            let stopped = {
                let work = job(leadership.clone());
                tokio::pin!(work);
                loop {
                    tokio::select! {
                        biased;
                        reason = leadership.lost() => break Stopped::Lost(reason),
                        _ = &mut shutdown => break Stopped::Shutdown,
                        () = &mut work => break Stopped::JobEnded,
                        Some(seen) = next_observed(&mut observer) => self.tell(seen),
                    }
                }
                // The job's future is dropped here, before anything else happens.
            };
            if let Some(callback) = &mut self.on_stopped_leading {
                callback(stopped);
            }
            if let Stopped::Lost(_) = stopped {
                // The candidacy campaigns again on its own.
                drop(leadership);
                continue;
            }
            // Ends the current term as well.
            candidacy.resign().await;
            return Ok(());
        }
    }

    fn tell(&mut self, seen: Observed) {
        if let (Some(callback), Observed::Leader(leader)) = (&mut self.on_new_leader, seen) {
            callback(leader.as_ref());
        }
    }
}

/// The observer's next state, or never when there is no observer.
async fn next_observed(observer: &mut Option<Observer>) -> Option<Observed> {
    match observer {
        Some(observer) => observer.next().await,
        None => std::future::pending().await,
    }
}

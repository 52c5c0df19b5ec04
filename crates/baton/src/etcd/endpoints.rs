//! Which of several endpoints requests may go to.
//!
//! tonic's balanced channel connects lazily and treats an endpoint whose connection failed as
//! ready, so it keeps sending requests to a member that is down: one dead member of three made
//! most starts fail. A client of several endpoints therefore balances only over the endpoints
//! it has seen answer. One task per endpoint asks it a cheap read (a count-only range of one
//! key) every [`CHECK_SERVING`] while it answers and every [`CHECK_FAILED`] while it does not,
//! and adds it to or removes it from the channel.
//!
//! The read's header names the endpoint's cluster. An endpoint that answers for another
//! cluster than the first one seen is never used: two separate servers in one URL would hand
//! out the same revisions, so the same token, to two leaders. [`Endpoints::ready`] waits for
//! every endpoint's first answer (bounded) so that such a URL is refused at start.
//!
//! A long-lived stream (a lease's renewals, the watches) does not go through the balanced
//! channel: it is opened on one serving endpoint's own connection ([`Endpoints::pick`], or
//! [`Endpoints::fastest`] once a stream went silent), and ended by its owner once that
//! endpoint fails a check ([`Endpoints::left`]). On
//! the balanced channel a stream stays on the member it was opened on; one that hangs (accepts
//! connections but never answers) would keep it silent until HTTP/2's pings gave up, 15 s on.

use std::sync::{Arc, Mutex};
use std::time::Duration;

use baton_etcd_proto::etcdserverpb as pb;
use baton_etcd_proto::etcdserverpb::kv_client::KvClient;
use tokio::sync::{mpsc, watch};
use tonic::transport::channel::Change;
use tonic::transport::{Channel, Endpoint};

/// Time between checks of an endpoint that answers.
const CHECK_SERVING: Duration = Duration::from_secs(2);
/// Time between checks of an endpoint that does not.
const CHECK_FAILED: Duration = Duration::from_millis(500);
/// Bound on one check, connecting included.
const CHECK_TIMEOUT: Duration = Duration::from_secs(2);

/// What the last check of an endpoint found.
#[derive(Debug, Clone, PartialEq, Eq)]
enum State {
    /// Not checked yet.
    Unchecked,
    /// It answered for the client's cluster: requests go to it.
    Serving,
    /// It did not answer: the reason, in one line.
    Failed(String),
    /// It answered for this other cluster: never used.
    OtherCluster(u64),
}

#[derive(Debug)]
struct Checks {
    /// Each endpoint as given, with its state.
    endpoints: Vec<(String, State)>,
    /// Each endpoint's own channel (connected when first used), for streams pinned to it.
    channels: Vec<Channel>,
    /// Each endpoint's failed checks so far.
    failures: Vec<u64>,
    /// The cluster the client uses: the first one an endpoint answered for.
    cluster: Option<u64>,
    /// Whether [`Endpoints::ready`] accepted the endpoints: from then on an endpoint of
    /// another cluster is a warning (before, it is the error `ready` returns).
    accepted: bool,
}

/// Why [`Endpoints::ready`] refused.
#[derive(Debug)]
pub(crate) enum NotReady {
    /// No endpoint answered; each endpoint with its reason.
    Unreachable(String),
    /// Endpoints answered for different clusters; which answered for which.
    ClustersDiffer(String),
}

/// The checks of a client's endpoints, shared with the tasks that run them.
#[derive(Debug, Clone)]
pub(crate) struct Endpoints {
    checks: Arc<Mutex<Checks>>,
    changed: watch::Sender<()>,
}

impl Endpoints {
    /// Starts checking `endpoints` (named by `names`), adding each to `channel`'s set through
    /// `changes` while it answers for the client's cluster. The tasks end once the channel is
    /// gone.
    pub(crate) fn start(
        names: Vec<String>,
        endpoints: Vec<Endpoint>,
        changes: mpsc::Sender<Change<usize, Endpoint>>,
    ) -> Endpoints {
        let checks = Checks {
            channels: endpoints.iter().map(Endpoint::connect_lazy).collect(),
            failures: vec![0; endpoints.len()],
            endpoints: names.into_iter().map(|n| (n, State::Unchecked)).collect(),
            cluster: None,
            accepted: false,
        };
        let (changed, _) = watch::channel(());
        let shared = Endpoints {
            checks: Arc::new(Mutex::new(checks)),
            changed,
        };
        for (index, endpoint) in endpoints.into_iter().enumerate() {
            tokio::spawn(keep_checking(
                index,
                endpoint,
                changes.clone(),
                shared.clone(),
            ));
        }
        shared
    }

    /// Waits until every endpoint was checked once, or `limit` passed with at least one
    /// serving; refuses when none serves or endpoints answered for different clusters.
    pub(crate) async fn ready(&self, limit: Duration) -> Result<(), NotReady> {
        let mut changed = self.changed.subscribe();
        let deadline = tokio::time::Instant::now() + limit;
        loop {
            {
                let mut checks = self.lock();
                if let Some(differ) = clusters_differ(&checks) {
                    return Err(NotReady::ClustersDiffer(differ));
                }
                let all_checked = checks
                    .endpoints
                    .iter()
                    .all(|(_, state)| *state != State::Unchecked);
                let serving = checks
                    .endpoints
                    .iter()
                    .any(|(_, state)| *state == State::Serving);
                let late = tokio::time::Instant::now() >= deadline;
                if (all_checked || late) && serving {
                    checks.accepted = true;
                    return Ok(());
                }
                if all_checked || late {
                    return Err(NotReady::Unreachable(failures(&checks)));
                }
            }
            let _ = tokio::time::timeout_at(deadline, changed.changed()).await;
        }
    }

    /// `None` while some endpoint serves; otherwise why none does, for the request's error.
    pub(crate) fn none_serving(&self) -> Option<String> {
        let checks = self.lock();
        let serving = checks
            .endpoints
            .iter()
            .any(|(_, state)| matches!(state, State::Serving | State::Unchecked));
        (!serving).then(|| format!("no endpoint answers ({})", failures(&checks)))
    }

    /// A serving endpoint's index and connection, for a stream pinned to it: another than
    /// `avoid` if another serves; `None` if none serves.
    pub(crate) fn pick(&self, avoid: Option<usize>) -> Option<(usize, Channel)> {
        let checks = self.lock();
        let serving = |index: &usize| checks.endpoints[*index].1 == State::Serving;
        let mut candidates = (0..checks.endpoints.len()).filter(serving);
        let first = candidates.next()?;
        let chosen = match avoid {
            Some(avoid) if first == avoid => candidates.next().unwrap_or(first),
            _ => first,
        };
        Some((chosen, checks.channels[chosen].clone()))
    }

    /// For a stream that went silent: the first endpoint to answer a read for the client's
    /// cluster now, every endpoint asked at once (the one that went silent too: it may be the
    /// only one back). A hung member counts as serving until a check has waited 2 s for it, and
    /// one that came back as failed until its next check, so neither the checks' states nor
    /// trying the endpoints in turn (a renew interval each) would find a live one in time.
    /// `None` if none answers within `limit`.
    pub(crate) async fn fastest(&self, limit: Duration) -> Option<(usize, Channel)> {
        let (ours, candidates): (Option<u64>, Vec<(usize, Channel)>) = {
            let checks = self.lock();
            let candidates = (0..checks.endpoints.len())
                .filter(|&index| !matches!(checks.endpoints[index].1, State::OtherCluster(_)))
                .map(|index| (index, checks.channels[index].clone()))
                .collect();
            (checks.cluster, candidates)
        };
        let mut asks = tokio::task::JoinSet::new();
        for (index, channel) in candidates {
            asks.spawn(async move {
                let mut kv = KvClient::new(channel.clone());
                let response = kv.range(probe_request()).await.ok()?.into_inner();
                let cluster = response.header.map_or(0, |header| header.cluster_id);
                ours.is_none_or(|ours| ours == cluster)
                    .then_some((index, channel))
            });
        }
        let first = async {
            while let Some(answer) = asks.join_next().await {
                if let Ok(Some(found)) = answer {
                    return Some(found);
                }
            }
            None
        };
        // The asks still out are aborted with the set.
        tokio::time::timeout(limit, first).await.ok().flatten()
    }

    /// Endpoint `index` as the URL gave it.
    pub(crate) fn name(&self, index: usize) -> String {
        self.lock()
            .endpoints
            .get(index)
            .map_or_else(String::new, |(name, _)| name.clone())
    }

    /// How many checks of endpoint `index` have failed so far.
    pub(crate) fn failures(&self, index: usize) -> u64 {
        self.lock().failures.get(index).copied().unwrap_or(0)
    }

    /// Resolves once endpoint `index` has failed more checks than `failures`, or answered for
    /// another cluster: a stream pinned to it is then to be opened elsewhere. (Counted, not
    /// read off its state: a stream may be opened on an endpoint that answered
    /// [`Endpoints::fastest`] before its next check clears its last failure.)
    pub(crate) async fn left(&self, index: usize, failures: u64) {
        let mut changed = self.changed.subscribe();
        loop {
            {
                let checks = self.lock();
                let failed_since = checks.failures.get(index).is_none_or(|&now| now > failures);
                let other = matches!(
                    checks.endpoints.get(index),
                    Some((_, State::OtherCluster(_))) | None
                );
                if failed_since || other {
                    return;
                }
            }
            if changed.changed().await.is_err() {
                return;
            }
        }
    }

    fn lock(&self) -> std::sync::MutexGuard<'_, Checks> {
        // A panic elsewhere cannot leave the states half-written: each update is one store.
        self.checks.lock().unwrap_or_else(|e| e.into_inner())
    }

    /// Records what a check of endpoint `index` found (a failure is counted, for
    /// [`Endpoints::left`]); returns whether requests may go to it.
    fn record(&self, index: usize, found: Result<u64, String>) -> bool {
        let mut checks = self.lock();
        let state = match found {
            Err(reason) => State::Failed(reason),
            Ok(cluster) => match checks.cluster {
                None => {
                    checks.cluster = Some(cluster);
                    State::Serving
                }
                Some(ours) if ours == cluster => State::Serving,
                Some(_) => State::OtherCluster(cluster),
            },
        };
        let accepted = checks.accepted;
        let failed = matches!(state, State::Failed(_));
        if failed {
            checks.failures[index] += 1;
        }
        let (name, old) = &mut checks.endpoints[index];
        if *old != state {
            if let (State::OtherCluster(cluster), true) = (&state, accepted) {
                tracing::warn!(
                    endpoint = %name,
                    cluster = format_args!("{cluster:x}"),
                    "an etcd endpoint answers for another cluster than the others; it is not used"
                );
            }
            *old = state.clone();
            drop(checks);
            self.changed.send_replace(());
        } else if failed {
            // Streams pinned to it wait for any failed check (see `left`).
            drop(checks);
            self.changed.send_replace(());
        }
        state == State::Serving
    }
}

/// Which endpoint answered for which cluster, when they differ.
fn clusters_differ(checks: &Checks) -> Option<String> {
    let ours = checks.cluster?;
    let other = checks
        .endpoints
        .iter()
        .any(|(_, state)| matches!(state, State::OtherCluster(_)));
    other.then(|| {
        checks
            .endpoints
            .iter()
            .filter_map(|(name, state)| match state {
                State::Serving => Some(format!("{name} is cluster {ours:x}")),
                State::OtherCluster(cluster) => Some(format!("{name} is cluster {cluster:x}")),
                _ => None,
            })
            .collect::<Vec<_>>()
            .join("; ")
    })
}

/// Each endpoint that does not serve, with why.
fn failures(checks: &Checks) -> String {
    checks
        .endpoints
        .iter()
        .filter_map(|(name, state)| match state {
            State::Failed(reason) => Some(format!("{name}: {reason}")),
            State::Unchecked => Some(format!("{name}: no answer yet")),
            State::OtherCluster(cluster) => Some(format!("{name}: another cluster ({cluster:x})")),
            State::Serving => None,
        })
        .collect::<Vec<_>>()
        .join("; ")
}

/// Checks endpoint `index` until the channel is gone, keeping it in the channel's set exactly
/// while it serves.
async fn keep_checking(
    index: usize,
    endpoint: Endpoint,
    changes: mpsc::Sender<Change<usize, Endpoint>>,
    endpoints: Endpoints,
) {
    let mut probe: Option<Channel> = None;
    let mut in_set = false;
    while !changes.is_closed() {
        let found = check(&endpoint, &mut probe).await;
        let serving = endpoints.record(index, found);
        if serving != in_set {
            let change = if serving {
                Change::Insert(index, endpoint.clone())
            } else {
                Change::Remove(index)
            };
            if changes.send(change).await.is_err() {
                return;
            }
            in_set = serving;
        }
        tokio::time::sleep(if serving { CHECK_SERVING } else { CHECK_FAILED }).await;
    }
}

/// One check: the cluster the endpoint answers for, or why it did not answer. The connection
/// is kept for the next check, and dropped after a failure.
async fn check(endpoint: &Endpoint, probe: &mut Option<Channel>) -> Result<u64, String> {
    let ask = async {
        if probe.is_none() {
            let channel = endpoint
                .connect()
                .await
                .map_err(|e| cause(tonic::Status::from_error(Box::new(e))))?;
            *probe = Some(channel);
        }
        let Some(channel) = probe.as_ref() else {
            return Err("no connection".to_string());
        };
        let mut kv = KvClient::new(channel.clone());
        let response = kv.range(probe_request()).await.map_err(cause)?.into_inner();
        Ok(response.header.map_or(0, |header| header.cluster_id))
    };
    let found = match tokio::time::timeout(CHECK_TIMEOUT, ask).await {
        Ok(found) => found,
        Err(_) => Err(format!("no answer within {}s", CHECK_TIMEOUT.as_secs())),
    };
    if found.is_err() {
        *probe = None;
    }
    found
}

/// The cheapest read there is: how many keys are `\0`.
fn probe_request() -> pb::RangeRequest {
    pb::RangeRequest {
        key: b"\0".to_vec(),
        count_only: true,
        ..Default::default()
    }
}

/// Why a check failed, as the backend's errors say it (the operating system's "Connection
/// refused", not a page of gRPC status), without commas, so that it survives being quoted in
/// a status message.
fn cause(status: tonic::Status) -> String {
    super::root_cause(&super::client::Error::GRpcStatus(status)).replace(',', ";")
}

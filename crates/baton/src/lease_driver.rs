//! The lease driver: a thin loop around [`LeaseCore`], generic over how renewals travel.
//!
//! It publishes the lease's local deadline on a watch channel. Leaderships do not rely on this
//! task waking up in time: each one arms its own timer at the published deadline (see
//! [`crate::Leadership::lost`]), so a slow driver can delay renewals but never extend leadership.
//!
//! Deadlines are on the [`Clock`]'s timeline, which counts time the host spent suspended. tokio's
//! timers do not, so the driver also waits on an [`Alarm`] (a `CLOCK_BOOTTIME` timer) at its
//! next timeout: after a resume past the deadline it declares the lease over at once, and every
//! holder's `lost()` resolves.

use std::future::Future;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Arc;
use std::time::Duration;

use baton_core::{ElectionConfig, LeaseAction, LeaseCore};
use tokio::sync::{oneshot, watch};

use crate::clock::{Alarm, Clock};
use crate::error::{Error, Result};
use crate::metrics::DeadlineGauges;

/// What holders see of a lease.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum LeaseView {
    /// Holders may act until `deadline` (on the lease's [`Clock`], which counts suspended
    /// time).
    Live {
        /// The local deadline.
        deadline: baton_core::Instant,
    },
    /// Over: expired, gone at the server, or revoked.
    Over,
}

/// How a lease's grant and renewals reach the server.
pub(crate) trait LeaseTransport: Send + 'static {
    /// Requests a lease with `ttl`; returns the TTL the server granted.
    fn grant(&mut self, ttl: Duration) -> impl Future<Output = Result<Duration>> + Send;
    /// Sends one renewal (reconnecting the renewal stream if needed).
    fn send_renewal(&mut self) -> impl Future<Output = Result<()>> + Send;
    /// Forgets every renewal in flight: no answer to one of them may come out of
    /// [`LeaseTransport::next_renewal`] any more. The way they travelled (a stream, a
    /// connection) is given up; the next send opens another, on another server if it can.
    fn reopen(&mut self);
    /// Waits for the next renewal answer: the granted TTL, zero when the lease is gone. Must
    /// be cancel-safe and must pend (not fail repeatedly) while no stream is open.
    fn next_renewal(&mut self) -> impl Future<Output = Result<Duration>> + Send;
    /// Revokes the lease.
    fn revoke(&mut self) -> impl Future<Output = Result<()>> + Send;
}

/// What a holder keeps of a lease: its view, the clock its deadline is on, and what the
/// driver records for health checks and metrics.
#[derive(Debug, Clone)]
pub(crate) struct LeaseWatch {
    pub(crate) view: watch::Receiver<LeaseView>,
    pub(crate) clock: Clock,
    pub(crate) record: Arc<LeaseRecord>,
}

/// What the lease driver records beside its view, for [`crate::LeaseHealth`] and metrics.
#[derive(Debug)]
pub(crate) struct LeaseRecord {
    /// [`LeaseCore::acknowledged_send`] as nanoseconds on the lease's clock.
    acknowledged_send_nanos: AtomicU64,
    pub(crate) renew_interval: Duration,
    /// The time-left gauges of the terms held under this lease.
    pub(crate) deadlines: Arc<DeadlineGauges>,
}

impl LeaseRecord {
    /// Takes in the core's state after a grant or an answer. `before` is the acknowledged send
    /// before the answer: when it moved, the renewal sent then took `now − send` to answer.
    fn note(
        &self,
        core: &LeaseCore,
        before: Option<baton_core::Instant>,
        now: baton_core::Instant,
    ) {
        let Some(sent) = core.acknowledged_send() else {
            return;
        };
        self.acknowledged_send_nanos
            .store(sent.as_nanos(), Ordering::Relaxed);
        if before.is_some_and(|before| before < sent) {
            crate::metrics::renewal_latency(now - sent);
        }
    }
}

impl LeaseWatch {
    /// Whether the lease is live and its deadline has not passed, counting suspended time.
    pub(crate) fn is_live(&self) -> bool {
        match *self.view.borrow() {
            LeaseView::Live { deadline } => self.clock.now() < deadline,
            LeaseView::Over => false,
        }
    }

    /// The deadline as a tokio instant: now plus the time remaining on the lease's timeline
    /// (already past after a resume from a suspend beyond it). `None` once the lease is over.
    pub(crate) fn tokio_deadline(&self) -> Option<tokio::time::Instant> {
        match *self.view.borrow() {
            LeaseView::Live { deadline } => Some(self.clock.to_tokio(deadline)),
            LeaseView::Over => None,
        }
    }

    /// Time since the send of the latest acknowledged grant or renewal, on the lease's clock.
    pub(crate) fn since_acknowledged_send(&self) -> Duration {
        let sent = self.record.acknowledged_send_nanos.load(Ordering::Relaxed);
        self.clock.now() - baton_core::Instant::from_nanos(sent)
    }
}

/// A running lease: its view and the means to end it.
#[derive(Debug)]
pub(crate) struct LeaseHandle {
    pub(crate) watch: LeaseWatch,
    revoke: std::sync::Mutex<Option<oneshot::Sender<End>>>,
}

/// How a lease is ended on purpose.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum End {
    /// Revoke it at the server now.
    Revoke,
    /// Stop renewing and let it expire.
    Lapse,
}

impl LeaseHandle {
    pub(crate) fn is_live(&self) -> bool {
        self.watch.is_live()
    }

    /// Ends the lease: holders see it over at once, then the driver revokes it at the server.
    /// Works through a shared reference, so a lease shared by many candidates can be ended.
    pub(crate) fn request_revoke(&self) {
        self.end(End::Revoke);
    }

    /// Stops renewing: holders see the lease over at once and it lapses at the server a TTL
    /// later (after every holder's local deadline), taking its keys with it.
    pub(crate) fn stop_renewing(&self) {
        self.end(End::Lapse);
    }

    fn end(&self, how: End) {
        let sender = self.revoke.lock().unwrap_or_else(|e| e.into_inner()).take();
        if let Some(sender) = sender {
            let _ = sender.send(how);
        }
    }

    /// Revokes the lease at the server and waits until the driver has finished (the revoke
    /// itself is bounded by a timeout).
    pub(crate) async fn revoke(&self) {
        self.request_revoke();
        let mut view = self.watch.view.clone();
        // The driver drops its sender when it is done.
        while view.changed().await.is_ok() {}
    }
}

impl Drop for LeaseHandle {
    fn drop(&mut self) {
        // Dropping the sender wakes the driver, which revokes the lease.
        self.revoke.lock().unwrap_or_else(|e| e.into_inner()).take();
    }
}

/// Bound on the time one renewal send may take, including reconnecting.
fn send_timeout(config: &ElectionConfig) -> Duration {
    config.renew_interval().max(Duration::from_millis(50))
}

/// Grants a lease and spawns its driver.
pub(crate) async fn start_lease<T: LeaseTransport>(
    mut transport: T,
    config: ElectionConfig,
    clock: Clock,
) -> Result<LeaseHandle> {
    let mut core = LeaseCore::new(config.clone());
    core.start(clock.now());
    let Some(LeaseAction::Grant { ttl }) = core.poll_action() else {
        unreachable!("a started lease asks for a grant first");
    };
    let grant_timeout = config.local_lease(config.ttl);
    match tokio::time::timeout(grant_timeout, transport.grant(ttl)).await {
        Ok(Ok(granted)) => core.handle_granted(clock.now(), granted),
        Ok(Err(error)) => return Err(error),
        Err(_) => {
            crate::metrics::backend_error("lease grant");
            return Err(Error::Timeout {
                operation: "lease grant",
                after_ms: grant_timeout.as_millis() as u64,
            });
        }
    }
    if core.poll_action() == Some(LeaseAction::Expired) {
        return Err(Error::Timeout {
            operation: "lease grant (answer came after the local deadline)",
            after_ms: grant_timeout.as_millis() as u64,
        });
    }
    let deadline = core.deadline().expect("granted");
    let record = Arc::new(LeaseRecord {
        acknowledged_send_nanos: AtomicU64::new(0),
        renew_interval: config.renew_interval(),
        deadlines: Arc::default(),
    });
    record.note(&core, None, clock.now());
    record.deadlines.publish(deadline - clock.now());
    let (view_tx, view) = watch::channel(LeaseView::Live { deadline });
    let (revoke_tx, revoke_rx) = oneshot::channel();
    let alarm = clock.alarm();
    tokio::spawn(drive_lease(
        transport,
        core,
        config,
        alarm,
        clock.clone(),
        Outputs {
            view: view_tx,
            record: record.clone(),
        },
        revoke_rx,
    ));
    Ok(LeaseHandle {
        watch: LeaseWatch {
            view,
            clock,
            record,
        },
        revoke: std::sync::Mutex::new(Some(revoke_tx)),
    })
}

/// The lease driver's ends of its channels and records.
struct Outputs {
    view: watch::Sender<LeaseView>,
    record: Arc<LeaseRecord>,
}

impl Outputs {
    /// Tells holders the lease is over from this moment on.
    fn over(&self) {
        self.view.send_replace(LeaseView::Over);
        self.record.deadlines.over();
    }

    /// Publishes the deadline if it moved.
    fn live(&self, deadline: baton_core::Instant, clock: &Clock) {
        let live = LeaseView::Live { deadline };
        let moved = self.view.send_if_modified(|view| {
            let changed = *view != live;
            *view = live;
            changed
        });
        if moved {
            self.record.deadlines.publish(deadline - clock.now());
        }
    }
}

async fn drive_lease<T: LeaseTransport>(
    mut transport: T,
    mut core: LeaseCore,
    config: ElectionConfig,
    mut alarm: Alarm,
    clock: Clock,
    outputs: Outputs,
    mut revoke_rx: oneshot::Receiver<End>,
) {
    let mut revoke_open = true;
    loop {
        while let Some(action) = core.poll_action() {
            match action {
                LeaseAction::Grant { .. } => unreachable!("granted before the driver starts"),
                LeaseAction::Renew => {
                    let sent =
                        tokio::time::timeout(send_timeout(&config), transport.send_renewal());
                    match sent.await {
                        Ok(Ok(())) => {}
                        Ok(Err(_)) => core.handle_renew_failed(clock.now()),
                        Err(_) => {
                            crate::metrics::backend_error("lease keepalive");
                            core.handle_renew_failed(clock.now());
                        }
                    }
                }
                LeaseAction::Reopen => transport.reopen(),
                LeaseAction::Expired => {
                    outputs.over();
                    return;
                }
                LeaseAction::Revoke => {
                    outputs.over();
                    let revoke_timeout = send_timeout(&config);
                    if tokio::time::timeout(revoke_timeout, transport.revoke())
                        .await
                        .is_err()
                    {
                        crate::metrics::backend_error("lease revoke");
                    }
                    return;
                }
            }
        }
        if let Some(deadline) = core.deadline() {
            outputs.live(deadline, &clock);
        }
        let timeout = core.poll_timeout();
        let wake = timeout
            .map(|at| clock.to_tokio(at))
            .unwrap_or_else(|| tokio::time::Instant::now() + Duration::from_secs(3600));
        // tokio's timer does not count a suspend; the alarm does, so a timeout that passed while
        // the host slept is handled as soon as it wakes.
        if let Some(at) = timeout {
            alarm.arm(at);
        }
        tokio::select! {
            biased;
            end = &mut revoke_rx, if revoke_open => {
                revoke_open = false;
                if end == Ok(End::Lapse) {
                    outputs.over();
                    return;
                }
                // Revoked on purpose, or every handle dropped.
                core.revoke(clock.now());
            }
            _ = tokio::time::sleep_until(wake) => core.handle_timeout(clock.now()),
            _ = alarm.fired() => core.handle_timeout(clock.now()),
            answer = transport.next_renewal() => match answer {
                Ok(ttl) => {
                    let now = clock.now();
                    let before = core.acknowledged_send();
                    core.handle_renewed(now, ttl);
                    outputs.record.note(&core, before, now);
                }
                Err(_) => core.handle_renew_failed(clock.now()),
            },
        }
    }
}

#[cfg(test)]
mod tests {
    //! The real driver under tokio's paused clock, against a modelled lease server whose
    //! network can stall. The server follows etcd: a renewal received before expiry extends the
    //! lease to receive time + TTL; one received after expiry is answered with TTL 0.
    use super::*;
    use std::sync::{Arc, Mutex};
    use tokio::sync::mpsc;
    use tokio::time::Instant;

    const TTL: Duration = Duration::from_secs(2);

    #[derive(Debug, Default)]
    struct Server {
        expires_at: Option<Instant>,
        /// While true the network drops every renewal and answer.
        partitioned: bool,
        renewals_received: u32,
    }

    struct Transport {
        server: Arc<Mutex<Server>>,
        /// One-way latency.
        latency: Duration,
        answers_tx: mpsc::UnboundedSender<Duration>,
        answers_rx: mpsc::UnboundedReceiver<Duration>,
    }

    impl Transport {
        fn new(server: Arc<Mutex<Server>>, latency: Duration) -> Transport {
            let (answers_tx, answers_rx) = mpsc::unbounded_channel();
            Transport {
                server,
                latency,
                answers_tx,
                answers_rx,
            }
        }
    }

    impl LeaseTransport for Transport {
        async fn grant(&mut self, ttl: Duration) -> Result<Duration> {
            tokio::time::sleep(self.latency).await;
            self.server.lock().unwrap().expires_at = Some(Instant::now() + ttl);
            tokio::time::sleep(self.latency).await;
            Ok(ttl)
        }

        async fn send_renewal(&mut self) -> Result<()> {
            let server = self.server.clone();
            let latency = self.latency;
            let answers = self.answers_tx.clone();
            tokio::spawn(async move {
                tokio::time::sleep(latency).await;
                let ttl = {
                    let mut server = server.lock().unwrap();
                    if server.partitioned {
                        return;
                    }
                    server.renewals_received += 1;
                    let now = Instant::now();
                    match server.expires_at {
                        Some(at) if now < at => {
                            server.expires_at = Some(now + TTL);
                            TTL
                        }
                        _ => Duration::ZERO,
                    }
                };
                tokio::time::sleep(latency).await;
                if !server.lock().unwrap().partitioned {
                    let _ = answers.send(ttl);
                }
            });
            Ok(())
        }

        fn reopen(&mut self) {
            // Answers of the renewals sent so far go to the old channel, never read.
            (self.answers_tx, self.answers_rx) = mpsc::unbounded_channel();
        }

        async fn next_renewal(&mut self) -> Result<Duration> {
            match self.answers_rx.recv().await {
                Some(ttl) => Ok(ttl),
                None => std::future::pending().await,
            }
        }

        async fn revoke(&mut self) -> Result<()> {
            self.server.lock().unwrap().expires_at = None;
            Ok(())
        }
    }

    fn config() -> ElectionConfig {
        ElectionConfig::default().with_ttl(TTL)
    }

    /// A modelled server and a lease granted by it over a link with this one-way latency.
    /// On a clock that never sees a suspend: the host's `CLOCK_BOOTTIME − CLOCK_MONOTONIC`
    /// jitters by a few nanoseconds between reads, which would leak into exact timings.
    async fn granted(latency: Duration) -> (Arc<Mutex<Server>>, LeaseHandle) {
        granted_on(latency, Clock::with_injected_suspend().0).await
    }

    async fn granted_on(latency: Duration, clock: Clock) -> (Arc<Mutex<Server>>, LeaseHandle) {
        let server = Arc::new(Mutex::new(Server::default()));
        let transport = Transport::new(server.clone(), latency);
        let handle = start_lease(transport, config(), clock).await.unwrap();
        (server, handle)
    }

    /// When `Leadership::lost` resolves for a leadership held under this lease, with a driver
    /// that never reports anything itself.
    async fn local_loss(handle: &LeaseHandle) -> (Instant, baton_core::LossReason) {
        let (_status_tx, status) = watch::channel(crate::election::Status::Leading);
        let reason = crate::election::wait_lost(status, handle.watch.clone()).await;
        (Instant::now(), reason)
    }

    #[tokio::test(start_paused = true)]
    async fn renews_while_the_network_works() {
        let (server, handle) = granted(Duration::from_millis(5)).await;
        tokio::time::sleep(Duration::from_secs(60)).await;
        assert!(handle.is_live());
        // A renewal every ttl/3 for a minute.
        let received = server.lock().unwrap().renewals_received;
        assert!((88..=91).contains(&received), "{received} renewals");
    }

    #[tokio::test(start_paused = true)]
    async fn stalled_renewals_end_leadership_before_the_server_expires_the_lease() {
        let (server, handle) = granted(Duration::from_millis(20)).await;
        tokio::time::sleep(Duration::from_millis(5_000)).await;
        server.lock().unwrap().partitioned = true;
        let (lost_at, reason) = local_loss(&handle).await;
        assert_eq!(reason, baton_core::LossReason::LeaseExpired);
        let server_expiry = server.lock().unwrap().expires_at.unwrap();
        assert!(
            lost_at < server_expiry,
            "lost at {lost_at:?}, server expiry {server_expiry:?}"
        );
        // The margin is at least drift (1% of 2 s) plus the safety margin (100 ms).
        assert!(server_expiry - lost_at >= Duration::from_millis(120));
        // The driver reaches the same conclusion on its own timer.
        tokio::time::sleep(Duration::from_millis(1)).await;
        assert_eq!(*handle.watch.view.borrow(), LeaseView::Over);
    }

    #[tokio::test(start_paused = true)]
    async fn partition_healing_after_expiry_never_resurrects_the_lease() {
        let (server, handle) = granted(Duration::from_millis(20)).await;
        tokio::time::sleep(Duration::from_millis(1_000)).await;
        server.lock().unwrap().partitioned = true;
        let partitioned_at = Instant::now();
        let (lost_at, _) = local_loss(&handle).await;
        assert!(lost_at - partitioned_at < TTL);
        tokio::time::sleep(Duration::from_millis(6_000)).await;
        server.lock().unwrap().partitioned = false;
        tokio::time::sleep(Duration::from_millis(6_000)).await;
        assert_eq!(*handle.watch.view.borrow(), LeaseView::Over);
        assert!(!handle.is_live());
        // A leadership under it stays lost after the heal.
        let (_, reason) = local_loss(&handle).await;
        assert_eq!(reason, baton_core::LossReason::LeaseExpired);
        // The driver stopped renewing once over: nothing reached the healed server.
        let received_after_heal = server.lock().unwrap().renewals_received;
        tokio::time::sleep(Duration::from_secs(10)).await;
        assert_eq!(
            server.lock().unwrap().renewals_received,
            received_after_heal
        );
    }

    #[tokio::test(start_paused = true)]
    async fn slow_answers_are_counted_from_their_send_time() {
        // 700 ms each way: every answer is 1.4 s old when it arrives. The deadline must track
        // the send time, so the holder stays strictly inside the server's lease.
        let (server, handle) = granted(Duration::from_millis(700)).await;
        let mut view = handle.watch.view.clone();
        for _ in 0..20 {
            if view.changed().await.is_err() {
                break;
            }
            if let LeaseView::Live { deadline } = *view.borrow() {
                let deadline = handle.watch.clock.to_tokio(deadline);
                let server_expiry = server.lock().unwrap().expires_at.unwrap();
                assert!(deadline < server_expiry);
            }
        }
    }

    #[tokio::test(start_paused = true)]
    async fn a_suspend_longer_than_the_ttl_ends_leadership_at_once_on_resume() {
        let (clock, suspended) = Clock::with_injected_suspend();
        let (_server, handle) = granted_on(Duration::from_millis(5), clock).await;
        tokio::time::sleep(Duration::from_secs(5)).await;
        let lease = handle.watch.clone();
        let (_status_tx, status) = watch::channel(crate::election::Status::Leading);
        let leading = || *status.borrow() == crate::election::Status::Leading && lease.is_live();
        assert!(leading());
        // What `Leadership::lost` runs, waiting on tokio's timer at the deadline.
        let lost = tokio::spawn(crate::election::wait_lost(status.clone(), lease.clone()));
        tokio::task::yield_now().await;
        assert!(!lost.is_finished());
        let resumed_at = Instant::now();
        // The host was suspended for longer than the TTL: tokio's clock did not move.
        suspended.send_replace(TTL + Duration::from_secs(1));
        // Not leading from the first moment after the resume, and the deadline is in the past.
        assert!(!leading());
        assert!(!handle.is_live());
        // (The driver has not run since: nothing was awaited.)
        let deadline = lease.tokio_deadline().expect("still published as live");
        assert!(deadline < resumed_at);
        // `lost()` resolves without tokio's timers having to reach the deadline (the lease
        // driver's suspend-aware alarm ends the lease).
        let reason = lost.await.unwrap();
        assert_eq!(reason, baton_core::LossReason::LeaseExpired);
        assert_eq!(Instant::now(), resumed_at, "no tokio time passed");
        assert_eq!(*handle.watch.view.borrow(), LeaseView::Over);
    }

    #[tokio::test(start_paused = true)]
    async fn a_short_suspend_only_shortens_the_time_left() {
        let (clock, suspended) = Clock::with_injected_suspend();
        let (server, handle) = granted_on(Duration::from_millis(5), clock).await;
        // Renewals stop (say the host slept through them); then a 1 s suspend.
        server.lock().unwrap().partitioned = true;
        let partitioned_at = Instant::now();
        suspended.send_replace(Duration::from_secs(1));
        assert!(handle.is_live());
        let (_, reason) = local_loss(&handle).await;
        assert_eq!(reason, baton_core::LossReason::LeaseExpired);
        // The local lease is 1880 ms from the last acknowledged send; one second of it passed
        // during the suspend, so tokio's clock sees it end a second early.
        let lost_after = Instant::now() - partitioned_at;
        assert!(
            lost_after > Duration::from_millis(800) && lost_after <= Duration::from_millis(880),
            "{lost_after:?}"
        );
    }

    #[tokio::test(start_paused = true)]
    async fn renewals_are_timed_and_a_stall_shows_in_the_lease_health() {
        use metrics_util::debugging::{DebugValue, DebuggingRecorder};
        let recorder = DebuggingRecorder::new();
        let snapshotter = recorder.snapshotter();
        let _local = ::metrics::set_default_local_recorder(&recorder);
        let (server, handle) = granted(Duration::from_millis(20)).await;
        let health = crate::LeaseHealth::new(handle.watch.clone());
        assert_eq!(health.renew_interval(), TTL / 3);
        tokio::time::sleep(Duration::from_secs(5)).await;
        // A renewal every 667 ms, each answered 40 ms after its send.
        assert!(health.since_last_renewal() < TTL / 3 + Duration::from_millis(40));
        let latencies: Vec<f64> = snapshotter
            .snapshot()
            .into_vec()
            .into_iter()
            .filter(|(key, ..)| key.key().name() == crate::metrics::RENEWAL_LATENCY)
            .flat_map(|(.., value)| match value {
                DebugValue::Histogram(values) => values,
                other => panic!("{other:?}"),
            })
            .map(|value| value.into_inner())
            .collect();
        assert_eq!(latencies.len(), 7, "{latencies:?}");
        for latency in latencies {
            assert!((latency - 0.040).abs() < 1e-9, "{latency}");
        }
        // Renewals stall: the age of the last acknowledged send grows while the lease lives.
        server.lock().unwrap().partitioned = true;
        tokio::time::sleep(Duration::from_secs(1)).await;
        assert!(health.since_last_renewal() >= Duration::from_secs(1));
        assert!(health.is_live());
        local_loss(&handle).await;
        assert!(!health.is_live());
    }

    #[tokio::test(start_paused = true)]
    async fn dropping_the_handle_revokes() {
        let (server, handle) = granted(Duration::from_millis(1)).await;
        handle.revoke().await;
        assert_eq!(server.lock().unwrap().expires_at, None);
    }
}

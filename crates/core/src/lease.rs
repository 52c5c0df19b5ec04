//! One lease and safety rule 1: stop before anyone else can start.
//!
//! The server expires a lease `ttl` after it *receives* the last renewal. We cannot know when that
//! was, but we know when we *sent* it, which is earlier. So the holder's local deadline is
//!
//! ```text
//! deadline = send time of the last acknowledged grant/renewal
//!          + granted ttl × (1 − max_drift)   // the server's clock may run faster than ours
//!          − safety margin                   // time to actually stop the protected work
//! ```
//!
//! measured on the holder's own clock (one that keeps counting while the host is suspended, as
//! the server's lease does). At that instant [`LeaseCore`] emits
//! [`Action::Expired`] even if the server has said nothing; a rival can only win after the
//! server-side expiry, which is later. A late acknowledgement can only move the deadline to its
//! own send time plus the shrunk TTL, so it never stretches a lease past what the server granted.
//!
//! A renewal left unanswered for a whole renew interval is given up, with the stream it went
//! on ([`Action::Reopen`]), and sent again: a member that hangs, or a connection dropped
//! without a word, would otherwise swallow every renewal until the lease ran out.

use std::collections::VecDeque;
use std::time::Duration;

use crate::{ElectionConfig, Instant};

/// Shortest and longest pause before retrying a failed renewal.
const MIN_RETRY: Duration = Duration::from_millis(10);
const MAX_RETRY: Duration = Duration::from_millis(500);

/// What the driver must do next.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Action {
    /// Ask the server for a new lease with this TTL.
    Grant {
        /// The TTL to request.
        ttl: Duration,
    },
    /// Send one renewal now. The core has taken the `now` it was given as the send time.
    Renew,
    /// Forget every renewal in flight: an answer to one of them must never be fed to
    /// [`LeaseCore::handle_renewed`] (it would be matched to a later send time). A renewal
    /// failed, or the one in flight went unanswered for a whole renew interval, so the way
    /// renewals travel (a stream, a connection) is taken as dead: open another, on another
    /// server if there is one. A [`Action::Renew`] follows.
    Reopen,
    /// The lease is over (local deadline passed, or the server said it is gone): everything
    /// held under it must stop now.
    Expired,
    /// Revoke the lease at the server, releasing everything held under it at once.
    Revoke,
}

/// Where the lease is in its life.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum LeaseState {
    /// Not started.
    Idle,
    /// Grant sent, no answer yet.
    Granting,
    /// Granted and not yet past the local deadline.
    Active,
    /// Past the local deadline or gone at the server. Terminal.
    Expired,
    /// Revoked by us. Terminal.
    Revoked,
}

/// The sans-IO lease: grant, renew on schedule, and declare expiry at the local deadline.
///
/// Call order: [`LeaseCore::start`] once; then repeatedly feed results with `handle_*`, call
/// [`LeaseCore::handle_timeout`] when [`LeaseCore::poll_timeout`] passes, and drain
/// [`LeaseCore::poll_action`] after every call. [`LeaseCore::revoke`] ends it on purpose.
#[derive(Debug, Clone)]
pub struct LeaseCore {
    config: ElectionConfig,
    state: LeaseState,
    grant_sent_at: Option<Instant>,
    granted_ttl: Option<Duration>,
    deadline: Option<Instant>,
    /// Send time of the latest acknowledged grant or renewal: what the deadline counts from.
    acknowledged_send: Option<Instant>,
    next_renew_at: Option<Instant>,
    /// The send time of the renewal awaiting its answer. One at a time: the next is due a
    /// renew interval after it, which is when it is given up if still unanswered.
    renewal_in_flight: Option<Instant>,
    actions: VecDeque<Action>,
}

impl LeaseCore {
    /// A lease that will be requested with `config.ttl`. The config should be validated.
    pub fn new(config: ElectionConfig) -> LeaseCore {
        LeaseCore {
            config,
            state: LeaseState::Idle,
            grant_sent_at: None,
            granted_ttl: None,
            deadline: None,
            acknowledged_send: None,
            next_renew_at: None,
            renewal_in_flight: None,
            actions: VecDeque::new(),
        }
    }

    // Getters.

    /// The current state.
    pub fn state(&self) -> LeaseState {
        self.state
    }

    /// The local deadline, once granted. It never moves backwards while active.
    pub fn deadline(&self) -> Option<Instant> {
        self.deadline
    }

    /// The send time of the latest acknowledged grant or renewal (what the deadline counts
    /// from), once granted. It never moves backwards. `now` minus it is how long renewals have
    /// gone unacknowledged; when it moves, `now` minus it is that renewal's round trip.
    pub fn acknowledged_send(&self) -> Option<Instant> {
        self.acknowledged_send
    }

    /// The TTL the server granted.
    pub fn granted_ttl(&self) -> Option<Duration> {
        self.granted_ttl
    }

    /// Whether something may still act under this lease at `now`.
    pub fn is_live(&self, now: Instant) -> bool {
        self.state == LeaseState::Active && self.deadline.is_some_and(|deadline| now < deadline)
    }

    // Commands.

    /// Requests the lease. Only valid once, from [`LeaseState::Idle`].
    pub fn start(&mut self, now: Instant) {
        assert_eq!(self.state, LeaseState::Idle, "a lease core starts once");
        self.state = LeaseState::Granting;
        self.grant_sent_at = Some(now);
        self.actions.push_back(Action::Grant {
            ttl: self.config.ttl,
        });
    }

    /// Ends the lease on purpose: emits [`Action::Revoke`] unless it is already over.
    pub fn revoke(&mut self, _now: Instant) {
        if matches!(self.state, LeaseState::Granting | LeaseState::Active) {
            self.state = LeaseState::Revoked;
            self.renewal_in_flight = None;
            self.actions.push_back(Action::Revoke);
        }
    }

    // Inputs.

    /// The server granted the lease with `granted_ttl`.
    pub fn handle_granted(&mut self, now: Instant, granted_ttl: Duration) {
        if self.state != LeaseState::Granting {
            return;
        }
        let sent_at = self.grant_sent_at.expect("granting has a send time");
        if granted_ttl.is_zero() {
            self.become_expired();
            return;
        }
        self.state = LeaseState::Active;
        self.granted_ttl = Some(granted_ttl);
        let local_lease = self.config.local_lease(granted_ttl);
        self.deadline = Some(sent_at + local_lease);
        self.acknowledged_send = Some(sent_at);
        // A renew interval after the answer, but never later than a whole interval before the
        // deadline: a grant answered late (the server stalled, and granted when it woke) leaves
        // little of the lease, and waiting the full interval would let it run out locally
        // while the server holds it, ending a term that has barely begun.
        let interval = self.config.renew_interval();
        let latest = sent_at + local_lease.saturating_sub(interval);
        self.next_renew_at = Some((now + interval).min(latest));
        self.expire_if_due(now);
    }

    /// The grant failed; nothing was ever held.
    pub fn handle_grant_failed(&mut self, _now: Instant) {
        if self.state == LeaseState::Granting {
            self.become_expired();
        }
    }

    /// The server acknowledged the renewal in flight; the lease now has `granted_ttl`
    /// (zero means the server no longer knows the lease).
    pub fn handle_renewed(&mut self, now: Instant, granted_ttl: Duration) {
        if self.state != LeaseState::Active {
            // A late acknowledgement never resurrects an expired or revoked lease.
            return;
        }
        // Check the deadline first: if it passed while this answer was in flight (or while we
        // were paused), the holder has already been told to stop, and no answer revives it.
        if self.expire_if_due(now) {
            return;
        }
        let Some(sent_at) = self.renewal_in_flight.take() else {
            // An acknowledgement we did not ask for proves nothing about when the server
            // renewed; ignore it.
            return;
        };
        if granted_ttl.is_zero() {
            self.become_expired();
            return;
        }
        self.granted_ttl = Some(granted_ttl);
        let candidate = sent_at + self.config.local_lease(granted_ttl);
        let deadline = self.deadline.expect("active lease has a deadline");
        self.deadline = Some(deadline.max(candidate));
        // Sends go one at a time, so this only moves forward.
        assert!(self
            .acknowledged_send
            .is_some_and(|previous| previous <= sent_at));
        self.acknowledged_send = Some(sent_at);
        self.expire_if_due(now);
    }

    /// A renewal failed in transit (stream broken, timeout). Outstanding renewals are forgotten
    /// ([`Action::Reopen`]) and a new one is scheduled soon; the deadline is unchanged.
    pub fn handle_renew_failed(&mut self, now: Instant) {
        if self.state != LeaseState::Active {
            return;
        }
        self.renewal_in_flight = None;
        self.actions.push_back(Action::Reopen);
        let retry = (self.config.renew_interval() / 4).clamp(MIN_RETRY, MAX_RETRY);
        self.next_renew_at = Some(now + retry);
        self.expire_if_due(now);
    }

    /// The server said the lease does not exist (expired or revoked elsewhere).
    pub fn handle_lease_gone(&mut self, _now: Instant) {
        if matches!(self.state, LeaseState::Granting | LeaseState::Active) {
            self.become_expired();
        }
    }

    /// Time passed: expire at the deadline, renew when due.
    pub fn handle_timeout(&mut self, now: Instant) {
        if self.state != LeaseState::Active {
            return;
        }
        if self.expire_if_due(now) {
            return;
        }
        if self.unanswered_until().is_some_and(|until| now >= until) {
            // A server answers a renewal in milliseconds; one silent for a whole interval is
            // behind a stream that goes nowhere (a member that hangs, a connection a
            // middlebox dropped without a word), which would stay silent until the lease ran
            // out. Give those renewals up and send again at once, on a new stream.
            self.renewal_in_flight = None;
            self.actions.push_back(Action::Reopen);
            self.next_renew_at = Some(now);
        }
        let due = self.next_renew_at.is_some_and(|at| now >= at);
        if due && self.renewal_in_flight.is_none() {
            self.renewal_in_flight = Some(now);
            self.next_renew_at = Some(now + self.config.renew_interval());
            self.actions.push_back(Action::Renew);
        }
    }

    // Outputs.

    /// The next thing the driver must do.
    pub fn poll_action(&mut self) -> Option<Action> {
        self.actions.pop_front()
    }

    /// When to call [`LeaseCore::handle_timeout`] next.
    pub fn poll_timeout(&self) -> Option<Instant> {
        if self.state != LeaseState::Active {
            return None;
        }
        let deadline = self.deadline?;
        let first = [self.next_renew_at, self.unanswered_until()]
            .into_iter()
            .flatten()
            .fold(deadline, Instant::min);
        Some(first)
    }

    /// When the renewal in flight will have gone unanswered for a renew interval.
    fn unanswered_until(&self) -> Option<Instant> {
        Some(self.renewal_in_flight? + self.config.renew_interval())
    }

    fn expire_if_due(&mut self, now: Instant) -> bool {
        let due = self.deadline.is_some_and(|deadline| now >= deadline);
        if due {
            self.become_expired();
        }
        due
    }

    fn become_expired(&mut self) {
        self.state = LeaseState::Expired;
        self.renewal_in_flight = None;
        self.next_renew_at = None;
        self.actions.push_back(Action::Expired);
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn ms(n: u64) -> Duration {
        Duration::from_millis(n)
    }

    fn at(n: u64) -> Instant {
        Instant::from_millis(n)
    }

    /// TTL 2 s, renew every 600 ms, 1% drift, 100 ms margin: local lease 1880 ms.
    fn config() -> ElectionConfig {
        ElectionConfig::default()
            .with_ttl(ms(2000))
            .with_renew_interval(ms(600))
            .with_max_drift_ppm(10_000)
            .with_safety_margin(ms(100))
    }

    fn drain(core: &mut LeaseCore) -> Vec<Action> {
        std::iter::from_fn(|| core.poll_action()).collect()
    }

    fn granted(grant_sent: u64, granted_at: u64) -> LeaseCore {
        let mut core = LeaseCore::new(config());
        core.start(at(grant_sent));
        assert_eq!(drain(&mut core), vec![Action::Grant { ttl: ms(2000) }]);
        core.handle_granted(at(granted_at), ms(2000));
        assert_eq!(drain(&mut core), vec![]);
        core
    }

    #[test]
    fn deadline_counts_from_the_grant_send_time() {
        let core = granted(100, 400);
        assert_eq!(core.state(), LeaseState::Active);
        // Sent at 100, not answered at 400: 100 + 1880.
        assert_eq!(core.deadline(), Some(at(1980)));
        // Renew 600 ms after the answer, which is before the deadline.
        assert_eq!(core.poll_timeout(), Some(at(1000)));
        assert!(core.is_live(at(1979)));
        assert!(!core.is_live(at(1980)));
    }

    /// A grant answered 1.5 s after it was sent (a server that stalled and granted when it
    /// woke): 380 ms of the lease are left, so the first renewal is due at once, and its answer
    /// gives a whole lease again.
    #[test]
    fn a_late_grant_is_renewed_at_once() {
        let mut core = granted(0, 1500);
        assert_eq!(core.deadline(), Some(at(1880)));
        assert!(core.poll_timeout().is_some_and(|t| t <= at(1500)));
        core.handle_timeout(at(1500));
        assert_eq!(drain(&mut core), vec![Action::Renew]);
        core.handle_renewed(at(1510), ms(2000));
        assert_eq!(core.deadline(), Some(at(1500 + 1880)));
    }

    #[test]
    fn renewal_extends_from_its_send_time() {
        let mut core = granted(0, 10);
        assert_eq!(core.acknowledged_send(), Some(at(0)));
        core.handle_timeout(at(609));
        assert_eq!(drain(&mut core), vec![]);
        core.handle_timeout(at(610));
        assert_eq!(drain(&mut core), vec![Action::Renew]);
        assert_eq!(core.poll_timeout(), Some(at(1210)));
        // Sent, not yet acknowledged.
        assert_eq!(core.acknowledged_send(), Some(at(0)));
        core.handle_renewed(at(700), ms(2000));
        assert_eq!(drain(&mut core), vec![]);
        assert_eq!(core.deadline(), Some(at(610 + 1880)));
        assert_eq!(core.acknowledged_send(), Some(at(610)));
    }

    #[test]
    fn acknowledged_send_stays_put_while_renewals_go_unanswered() {
        let mut core = granted(0, 10);
        core.handle_timeout(at(610));
        assert_eq!(drain(&mut core), vec![Action::Renew]);
        // Unanswered for an interval: given up, and sent again on a new stream.
        core.handle_timeout(at(1210));
        assert_eq!(drain(&mut core), vec![Action::Reopen, Action::Renew]);
        core.handle_renew_failed(at(1300));
        assert_eq!(drain(&mut core), vec![Action::Reopen]);
        assert_eq!(core.acknowledged_send(), Some(at(0)));
        // A renewal after the failure, answered: it moves to that send.
        core.handle_timeout(at(1450));
        assert_eq!(drain(&mut core), vec![Action::Renew]);
        core.handle_renewed(at(1460), ms(2000));
        assert_eq!(core.acknowledged_send(), Some(at(1450)));
    }

    #[test]
    fn expires_at_the_deadline_when_the_server_is_silent() {
        let mut core = granted(0, 10);
        // Renewals go out but are never answered: each is given up after an interval and
        // sent again on a new stream, and none of that moves the deadline.
        core.handle_timeout(at(610));
        assert_eq!(drain(&mut core), vec![Action::Renew]);
        for now in [1210, 1810] {
            core.handle_timeout(at(now));
            assert_eq!(
                drain(&mut core),
                vec![Action::Reopen, Action::Renew],
                "at {now}"
            );
        }
        assert_eq!(core.poll_timeout(), Some(at(1880)));
        core.handle_timeout(at(1879));
        assert_eq!(drain(&mut core), vec![]);
        core.handle_timeout(at(1880));
        assert_eq!(drain(&mut core), vec![Action::Expired]);
        assert_eq!(core.state(), LeaseState::Expired);
        assert_eq!(core.poll_timeout(), None);
        // Nothing more happens, whatever arrives.
        core.handle_timeout(at(5000));
        core.handle_renewed(at(5000), ms(2000));
        assert_eq!(drain(&mut core), vec![]);
        assert_eq!(core.state(), LeaseState::Expired);
    }

    #[test]
    fn late_ack_only_counts_from_its_send_time() {
        let mut core = granted(0, 10);
        core.handle_timeout(at(610));
        assert_eq!(drain(&mut core), vec![Action::Renew]);
        // The answer to the renewal sent at 610 arrives at 2400 (say, after a pause that hid
        // the deadline timer): the deadline (1880) has already passed, so the core expires
        // rather than extending to 610 + 1880 = 2490.
        core.handle_renewed(at(2400), ms(2000));
        assert_eq!(drain(&mut core), vec![Action::Expired]);
        assert_eq!(core.deadline(), Some(at(1880)));
        assert_eq!(core.state(), LeaseState::Expired);
    }

    #[test]
    fn deadline_never_moves_backwards() {
        let mut core = granted(0, 10);
        core.handle_timeout(at(610));
        drain(&mut core);
        core.handle_renewed(at(620), ms(2000));
        assert_eq!(core.deadline(), Some(at(2490)));
        core.handle_timeout(at(1210));
        drain(&mut core);
        // The server shortened the TTL: 1210 + 1000·0.99 − 100 = 2100 < 2490.
        core.handle_renewed(at(1220), ms(1000));
        assert_eq!(core.deadline(), Some(at(2490)));
    }

    #[test]
    fn zero_ttl_answer_means_the_lease_is_gone() {
        let mut core = granted(0, 10);
        core.handle_timeout(at(610));
        drain(&mut core);
        core.handle_renewed(at(620), Duration::ZERO);
        assert_eq!(drain(&mut core), vec![Action::Expired]);
    }

    #[test]
    fn failed_renewal_retries_soon_without_moving_the_deadline() {
        let mut core = granted(0, 10);
        core.handle_timeout(at(610));
        drain(&mut core);
        core.handle_renew_failed(at(700));
        // The transport forgets what was in flight at once; retry after renew/4 = 150 ms.
        assert_eq!(drain(&mut core), vec![Action::Reopen]);
        assert_eq!(core.poll_timeout(), Some(at(850)));
        core.handle_timeout(at(850));
        assert_eq!(drain(&mut core), vec![Action::Renew]);
        assert_eq!(core.deadline(), Some(at(1880)));
        core.handle_renewed(at(900), ms(2000));
        assert_eq!(core.deadline(), Some(at(850 + 1880)));
    }

    #[test]
    fn a_silent_server_never_has_more_than_one_renewal_in_flight() {
        let mut core = granted(0, 10);
        core.config = config().with_renew_interval(ms(100));
        let mut actions = Vec::new();
        for now in (610..1800).step_by(10) {
            core.handle_timeout(at(now));
            actions.extend(drain(&mut core));
            assert!(core.renewal_in_flight.into_iter().count() <= 1, "at {now}");
        }
        // One renewal, then every interval a reopen and a renewal; the deadline stays put.
        assert_eq!(actions[0], Action::Renew);
        assert_eq!(actions.len(), 1 + 2 * 11);
        assert!(actions[1..]
            .chunks(2)
            .all(|pair| pair == [Action::Reopen, Action::Renew]));
        assert_eq!(core.deadline(), Some(at(1880)));
    }

    #[test]
    fn a_renewal_unanswered_for_an_interval_is_given_up_and_sent_again() {
        let mut core = granted(0, 10);
        core.handle_timeout(at(610));
        assert_eq!(drain(&mut core), vec![Action::Renew]);
        // Wake when the next renewal is due, which is also when this one has waited an
        // interval.
        assert_eq!(core.poll_timeout(), Some(at(1210)));
        // An answer just inside the interval counts.
        let mut answered = core.clone();
        answered.handle_renewed(at(1209), ms(2000));
        assert_eq!(answered.deadline(), Some(at(610 + 1880)));
        // None by then: given up, and sent again at once.
        core.handle_timeout(at(1210));
        assert_eq!(drain(&mut core), vec![Action::Reopen, Action::Renew]);
        assert_eq!(core.deadline(), Some(at(1880)));
        // The new stream's answer counts from the new send.
        core.handle_renewed(at(1215), ms(2000));
        assert_eq!(core.deadline(), Some(at(1210 + 1880)));
        assert_eq!(core.acknowledged_send(), Some(at(1210)));
    }

    /// The retry after a failure is the renewal in flight: its answer counts from its own
    /// send, and it is given up an interval after it, when the next one is due.
    #[test]
    fn a_retry_after_a_failure_counts_from_its_own_send() {
        let mut core = granted(0, 10);
        core.handle_timeout(at(610));
        drain(&mut core);
        core.handle_renew_failed(at(700));
        core.handle_timeout(at(850));
        assert_eq!(drain(&mut core), vec![Action::Reopen, Action::Renew]);
        // Next due at 1450, when the retry will also have waited an interval.
        assert_eq!(core.poll_timeout(), Some(at(1450)));
        core.handle_renewed(at(1400), ms(2000));
        assert_eq!(core.deadline(), Some(at(850 + 1880)));
    }

    #[test]
    fn grant_answer_after_the_local_lease_expires_at_once() {
        let mut core = LeaseCore::new(config());
        core.start(at(0));
        drain(&mut core);
        core.handle_granted(at(1900), ms(2000));
        assert_eq!(drain(&mut core), vec![Action::Expired]);
    }

    #[test]
    fn grant_failure_and_revoke() {
        let mut core = LeaseCore::new(config());
        core.start(at(0));
        drain(&mut core);
        core.handle_grant_failed(at(5));
        assert_eq!(drain(&mut core), vec![Action::Expired]);

        let mut core = granted(0, 10);
        core.revoke(at(20));
        assert_eq!(drain(&mut core), vec![Action::Revoke]);
        assert_eq!(core.state(), LeaseState::Revoked);
        core.revoke(at(30));
        core.handle_timeout(at(5000));
        assert_eq!(drain(&mut core), vec![]);
    }

    #[test]
    fn lease_gone_expires() {
        let mut core = granted(0, 10);
        core.handle_lease_gone(at(50));
        assert_eq!(drain(&mut core), vec![Action::Expired]);
    }
}

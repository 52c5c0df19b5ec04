//! Metrics: what baton records through the [`metrics`](https://docs.rs/metrics) facade.
//!
//! The library only calls `counter!`, `gauge!` and `histogram!`; it installs no recorder and
//! forces no exporter. Without a recorder every call is a no-op. To see them, install one in
//! your binary (for Prometheus, `metrics-exporter-prometheus`; `baton run --metrics ADDR`
//! does exactly that) and call [`describe`] once after installing it to get help texts.
//!
//! | name | type | labels | meaning |
//! |---|---|---|---|
//! | `baton_is_leader` | gauge | `election` | 1 while this process leads the election (0 from the moment its lease is over), else 0 |
//! | `baton_leadership_transitions_total` | counter | `election` | times this process became leader |
//! | `baton_losses_total` | counter | `election`, `reason` | leaderships, or campaigns, that ended other than by resigning |
//! | `baton_renewal_latency_seconds` | histogram | — | per lease: from sending a renewal to its acknowledgement |
//! | `baton_deadline_remaining_seconds` | gauge | `election` | time left to the local deadline while leading, as of the last renewal; 0 when not leading |
//! | `baton_backend_errors_total` | counter | `operation` | failed backend requests (errors and timeouts) |
//!
//! `reason` is one of `lease_expired`, `entry_deleted`, `backend_failed`, `token_regressed`
//! (see [`LossReason`]); `operation` names the request, such as `create candidate key`,
//! `find predecessor`, `lease keepalive` or `watch`.
//!
//! `baton_deadline_remaining_seconds` is set when the deadline moves (on every acknowledged
//! renewal) and when a term begins or ends, not on a timer: between renewals the real time left
//! is lower by the time since. Renewals are per lease, and one lease serves every election of a
//! [`crate::Backend`] with the same lease settings, hence no `election` label on the latency.
//!
//! Every label value is bounded: election names are the ones you campaign in, reasons and
//! operations are fixed strings.

use std::collections::BTreeMap;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::{Arc, Mutex};
use std::time::Duration;

use baton_core::LossReason;

/// `baton_is_leader{election}`: gauge, 1 while this process leads the election, else 0.
pub const IS_LEADER: &str = "baton_is_leader";
/// `baton_leadership_transitions_total{election}`: counter, times this process became leader.
pub const LEADERSHIP_TRANSITIONS: &str = "baton_leadership_transitions_total";
/// `baton_losses_total{election,reason}`: counter, leaderships or campaigns that ended other
/// than by resigning, by [`reason_label`].
pub const LOSSES: &str = "baton_losses_total";
/// `baton_renewal_latency_seconds`: histogram, per lease, from sending a renewal to its
/// acknowledgement.
pub const RENEWAL_LATENCY: &str = "baton_renewal_latency_seconds";
/// `baton_deadline_remaining_seconds{election}`: gauge, time left to the local deadline while
/// leading, as of the last time the deadline moved; 0 when not leading.
pub const DEADLINE_REMAINING: &str = "baton_deadline_remaining_seconds";
/// `baton_backend_errors_total{operation}`: counter, failed backend requests.
pub const BACKEND_ERRORS: &str = "baton_backend_errors_total";

/// The `reason` label of a loss: snake case, stable.
pub fn reason_label(reason: LossReason) -> &'static str {
    match reason {
        LossReason::LeaseExpired => "lease_expired",
        LossReason::EntryDeleted => "entry_deleted",
        LossReason::BackendFailed => "backend_failed",
        LossReason::TokenRegressed => "token_regressed",
    }
}

/// Registers unit and help text of every metric above with the recorder installed now.
/// Optional: it only adds `# HELP` lines and units to what the recorder shows.
pub fn describe() {
    use ::metrics::{describe_counter, describe_gauge, describe_histogram, Unit};
    describe_gauge!(IS_LEADER, "1 while this process leads the election, else 0");
    describe_counter!(LEADERSHIP_TRANSITIONS, "times this process became leader");
    describe_counter!(
        LOSSES,
        "leaderships or campaigns that ended other than by resigning, by reason"
    );
    describe_histogram!(
        RENEWAL_LATENCY,
        Unit::Seconds,
        "per lease: from sending a renewal to its acknowledgement"
    );
    describe_gauge!(
        DEADLINE_REMAINING,
        Unit::Seconds,
        "time left to the local deadline while leading, as of the last renewal"
    );
    describe_counter!(
        BACKEND_ERRORS,
        "failed backend requests (errors and timeouts)"
    );
}

/// One failed backend request.
pub(crate) fn backend_error(operation: &'static str) {
    ::metrics::counter!(BACKEND_ERRORS, "operation" => operation).increment(1);
}

/// One renewal acknowledged `latency` after it was sent.
pub(crate) fn renewal_latency(latency: Duration) {
    ::metrics::histogram!(RENEWAL_LATENCY).record(latency.as_secs_f64());
}

/// A leadership or campaign ended by `reason` (not by resigning).
pub(crate) fn lost(election: &str, reason: LossReason) {
    let election = election.to_string();
    ::metrics::counter!(LOSSES, "election" => election, "reason" => reason_label(reason))
        .increment(1);
}

/// A candidacy of `election` starts: `baton_is_leader` exists (at 0 unless a term is on)
/// from the start of the campaign, not only from the first election.
pub(crate) fn campaigning(election: &str) {
    ::metrics::gauge!(IS_LEADER, "election" => election.to_string()).increment(0.0);
}

/// The time-left gauges of the terms held under one lease, and their `baton_is_leader`: the
/// lease driver sets the time left whenever the deadline moves, and ends every term's
/// `baton_is_leader` the moment the lease is over. The candidate driver ends a term only once it
/// gets round to it, and it may be waiting for a request to an unreachable backend then (a
/// leader whose lease ran out went on counting as one until its process exited).
#[derive(Debug, Default)]
pub(crate) struct DeadlineGauges {
    /// Each term's election, time-left gauge and, while the term counts as leading, its
    /// `baton_is_leader` (moved back down when the lease ends or the term does).
    gauges: Mutex<BTreeMap<u64, Registered>>,
    next: AtomicU64,
    /// The time left as of the last publication, in nanoseconds, for gauges registered later.
    remaining_nanos: AtomicU64,
    /// The lease is over: a term registered now does not count as leading.
    over: AtomicBool,
}

#[derive(Debug)]
struct Registered {
    election: String,
    time_left: ::metrics::Gauge,
    is_leader: Option<::metrics::Gauge>,
}

impl DeadlineGauges {
    /// Publishes the time left to every term under this lease (zero once the lease is over).
    pub(crate) fn publish(&self, remaining: Duration) {
        let nanos = u64::try_from(remaining.as_nanos()).unwrap_or(u64::MAX);
        self.remaining_nanos.store(nanos, Ordering::Relaxed);
        let gauges = self.gauges.lock().unwrap_or_else(|e| e.into_inner());
        for term in gauges.values() {
            term.time_left.set(remaining.as_secs_f64());
        }
    }

    /// The lease is over: no time left, and no term under it leads any more.
    pub(crate) fn over(&self) {
        self.over.store(true, Ordering::Relaxed);
        self.publish(Duration::ZERO);
        let mut gauges = self.gauges.lock().unwrap_or_else(|e| e.into_inner());
        for term in gauges.values_mut() {
            if let Some(is_leader) = term.is_leader.take() {
                is_leader.decrement(1.0);
            }
        }
    }

    /// A term of `election` begins: `is_leader` is moved up for it, unless the lease is over
    /// already (a scrape between an up and a down would show a leader that never was).
    fn register(&self, election: &str, is_leader: ::metrics::Gauge) -> u64 {
        let time_left = ::metrics::gauge!(DEADLINE_REMAINING, "election" => election.to_string());
        let nanos = self.remaining_nanos.load(Ordering::Relaxed);
        time_left.set(Duration::from_nanos(nanos).as_secs_f64());
        let id = self.next.fetch_add(1, Ordering::Relaxed);
        let mut gauges = self.gauges.lock().unwrap_or_else(|e| e.into_inner());
        let is_leader = if self.over.load(Ordering::Relaxed) {
            None
        } else {
            is_leader.increment(1.0);
            Some(is_leader)
        };
        gauges.insert(
            id,
            Registered {
                election: election.to_string(),
                time_left,
                is_leader,
            },
        );
        id
    }

    fn unregister(&self, id: u64) {
        let mut gauges = self.gauges.lock().unwrap_or_else(|e| e.into_inner());
        let Some(term) = gauges.remove(&id) else {
            return;
        };
        if let Some(is_leader) = term.is_leader {
            is_leader.decrement(1.0);
        }
        // Another term of the same election (a second candidacy in this process, elected
        // while this one was ending) owns the series now.
        if !gauges.values().any(|other| other.election == term.election) {
            term.time_left.set(0.0);
        }
    }
}

/// The metrics of one term of office, from election until it ends: counts the transition,
/// holds `baton_is_leader` up (until the term ends or its lease does) and keeps the time-left
/// gauge current. Dropping it ends the term's metrics, whatever ended the term.
///
/// `baton_is_leader` is moved by +1 and −1 rather than set, so that two candidacies of one
/// election in the same process (one resigning while the other is elected) cannot leave it
/// wrong whichever driver runs first.
#[derive(Debug)]
pub(crate) struct Term {
    deadline: Arc<DeadlineGauges>,
    deadline_id: u64,
}

impl Term {
    /// A term of `election` begins under `lease`.
    pub(crate) fn begin(election: &str, lease: &crate::lease_driver::LeaseWatch) -> Term {
        let deadline = &lease.record.deadlines;
        ::metrics::counter!(LEADERSHIP_TRANSITIONS, "election" => election.to_string())
            .increment(1);
        let is_leader = ::metrics::gauge!(IS_LEADER, "election" => election.to_string());
        let deadline_id = deadline.register(election, is_leader);
        Term {
            deadline: deadline.clone(),
            deadline_id,
        }
    }
}

impl Drop for Term {
    fn drop(&mut self) {
        self.deadline.unregister(self.deadline_id);
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// `baton_is_leader` moves up once for a term and down once when its lease ends; a term
    /// registered under a lease already over never moves it at all.
    #[test]
    fn a_term_under_a_lease_already_over_never_counts_as_leading() {
        #[derive(Default)]
        struct Moves(Mutex<Vec<f64>>);
        impl ::metrics::GaugeFn for Moves {
            fn increment(&self, value: f64) {
                self.0.lock().unwrap().push(value);
            }
            fn decrement(&self, value: f64) {
                self.0.lock().unwrap().push(-value);
            }
            fn set(&self, _: f64) {}
        }
        let moves = Arc::new(Moves::default());
        let gauge = || ::metrics::Gauge::from_arc(moves.clone());
        let gauges = DeadlineGauges::default();
        let term = gauges.register("e", gauge());
        gauges.over();
        gauges.unregister(term);
        assert_eq!(*moves.0.lock().unwrap(), vec![1.0, -1.0]);
        moves.0.lock().unwrap().clear();
        let late = gauges.register("e", gauge());
        gauges.unregister(late);
        assert_eq!(*moves.0.lock().unwrap(), Vec::<f64>::new());
    }

    #[test]
    fn reasons_are_snake_case() {
        assert_eq!(reason_label(LossReason::LeaseExpired), "lease_expired");
        assert_eq!(reason_label(LossReason::EntryDeleted), "entry_deleted");
        assert_eq!(reason_label(LossReason::BackendFailed), "backend_failed");
        assert_eq!(reason_label(LossReason::TokenRegressed), "token_regressed");
    }
}

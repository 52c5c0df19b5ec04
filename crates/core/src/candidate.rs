//! One campaign in one election: create a key, queue behind the predecessor, lead, lose, resign.
//!
//! The recipe is the one every backend shares. Each candidate owns one entry (etcd key,
//! ZooKeeper sequential znode) whose *position* orders the queue; the leader is the entry with
//! the lowest position, and its position is the fencing token. A waiter watches only the entry
//! immediately ahead of it, so a handoff wakes exactly one waiter (no herd). The lease that keeps
//! entries alive lives in [`crate::LeaseCore`]; this core only hears that it expired.
//!
//! A candidate never reports leadership it does not hold: any disappearance of its own entry is
//! a loss, and every path out of a campaign deletes what it created.

use std::collections::VecDeque;

/// Why a leadership or candidacy ended.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum LossReason {
    /// The lease reached its local deadline or vanished at the server.
    LeaseExpired,
    /// Our own key was deleted by someone else.
    EntryDeleted,
    /// The backend failed in a way we could not recover from.
    BackendFailed,
    /// Our new entry's position is not above a token this election already issued, or above
    /// an earlier entry of ours: the
    /// backend's history went backwards (restored from an older snapshot, or wiped). Final even
    /// with requeue, since every new entry would get a low token too.
    TokenRegressed,
}

impl std::fmt::Display for LossReason {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(match self {
            LossReason::LeaseExpired => "lease expired",
            LossReason::EntryDeleted => "leader entry deleted",
            LossReason::BackendFailed => "backend failed",
            LossReason::TokenRegressed => {
                "fencing token went backwards (the backend was restored from an older snapshot \
                 or wiped)"
            }
        })
    }
}

/// What the driver must do next.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Action {
    /// Create this candidate's entry under the election, bound to the current lease.
    CreateEntry,
    /// Look up the entry immediately ahead of ours (the highest position below `own_position`)
    /// and answer with [`Candidate::handle_predecessor`].
    FindPredecessor {
        /// Our entry's position.
        own_position: u64,
    },
    /// Wait until the entry with this position is deleted, then call
    /// [`Candidate::handle_predecessor_deleted`]. Also report our own entry's deletion.
    WatchPredecessor {
        /// The predecessor's position.
        position: u64,
    },
    /// We lead. Start acting, with `token` on every action.
    Elected {
        /// The fencing token: our entry's position.
        token: u64,
    },
    /// Leadership or candidacy ended. Stop acting at once.
    Lost {
        /// Why.
        reason: LossReason,
        /// Whether we were leading (rather than still waiting).
        was_leading: bool,
    },
    /// Delete our entry with this position (resign, or clean up after a loss).
    DeleteEntry {
        /// The position of the entry to delete.
        position: u64,
    },
}

/// Where the candidate is.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum CandidateState {
    /// Not campaigning.
    Idle,
    /// Entry being created.
    Creating,
    /// Entry created; looking for the predecessor.
    Positioning {
        /// Our position.
        own_position: u64,
    },
    /// Waiting for the predecessor to go.
    Queued {
        /// Our position.
        own_position: u64,
        /// The entry ahead of us.
        predecessor: u64,
    },
    /// Leading.
    Leading {
        /// Our position, the fencing token.
        token: u64,
    },
    /// Lost and not requeueing. Terminal.
    Lost(LossReason),
    /// Resigned. Terminal.
    Resigned,
}

/// The sans-IO candidate.
///
/// Call order: [`Candidate::campaign`]; then answer each [`Action`] with the matching
/// `handle_*` input (tokens of this election seen elsewhere go in with
/// [`Candidate::handle_token_seen`] before a `CreateEntry` is sent); report lease expiry with
/// [`Candidate::handle_lease_expired`]; end with [`Candidate::resign`]. Drain
/// [`Candidate::poll_action`] after every call. Time does not enter this core: deadlines belong
/// to [`crate::LeaseCore`].
#[derive(Debug, Clone)]
pub struct Candidate {
    requeue: bool,
    state: CandidateState,
    /// The highest token this election is known to have issued: ours, or one seen elsewhere.
    /// Every entry created later must have a higher position.
    last_token: Option<u64>,
    /// The highest position one of our own entries had, led or not: a healthy backend gives
    /// every later entry a higher one too (a waiter that never led knows no token, but it
    /// knows this).
    last_position: Option<u64>,
    actions: VecDeque<Action>,
}

impl Candidate {
    /// A candidate; with `requeue` it campaigns again after every loss.
    pub fn new(requeue: bool) -> Candidate {
        Candidate {
            requeue,
            state: CandidateState::Idle,
            last_token: None,
            last_position: None,
            actions: VecDeque::new(),
        }
    }

    // Getters.

    /// The current state.
    pub fn state(&self) -> CandidateState {
        self.state
    }

    /// The token while leading.
    pub fn token(&self) -> Option<u64> {
        match self.state {
            CandidateState::Leading { token } => Some(token),
            _ => None,
        }
    }

    /// The position of our entry while one exists (positioning, queued or leading).
    pub fn own_position(&self) -> Option<u64> {
        match self.state {
            CandidateState::Positioning { own_position }
            | CandidateState::Queued { own_position, .. } => Some(own_position),
            CandidateState::Leading { token } => Some(token),
            _ => None,
        }
    }

    /// The highest token this election is known to have issued (ours or seen elsewhere).
    pub fn highest_token(&self) -> Option<u64> {
        self.last_token
    }

    /// The highest position the election is known to have reached: a token it issued or one
    /// of our own entries. Every entry we create must come out above it.
    pub fn highest_reached(&self) -> Option<u64> {
        self.last_token.max(self.last_position)
    }

    /// Whether the candidacy is over for good.
    pub fn is_finished(&self) -> bool {
        matches!(
            self.state,
            CandidateState::Lost(_) | CandidateState::Resigned
        )
    }

    // Commands.

    /// Starts campaigning.
    pub fn campaign(&mut self) {
        if self.state == CandidateState::Idle {
            self.become_creating();
        }
    }

    /// Gives up: deletes our entry (if any) and ends the candidacy. No `Lost` is emitted: the
    /// caller asked for this.
    pub fn resign(&mut self) {
        if let Some(position) = self.own_position() {
            self.actions.push_back(Action::DeleteEntry { position });
        }
        if !self.is_finished() {
            self.state = CandidateState::Resigned;
        }
    }

    /// Ends the current term of office on purpose but, with requeue, keeps campaigning: deletes
    /// our entry and creates a new one. Without requeue it is [`Candidate::resign`]. No `Lost`
    /// is emitted: the caller asked for this.
    pub fn step_down(&mut self) {
        if !self.requeue {
            return self.resign();
        }
        if let CandidateState::Leading { token } = self.state {
            self.actions
                .push_back(Action::DeleteEntry { position: token });
            self.become_creating();
        }
    }

    /// Stops requeueing for good: nobody can receive another term (the owner's handle is
    /// gone). From now on a loss ends the candidacy and [`Candidate::step_down`] resigns; the
    /// current term, if any, is unaffected.
    pub fn stop_requeue(&mut self) {
        self.requeue = false;
    }

    // Inputs.

    /// A leader of this election held `token` (seen by another candidacy of this process, say).
    /// Only tokens seen before the current `CreateEntry` request was sent may be reported: the
    /// entry it creates must then have a higher position, or the backend went backwards.
    pub fn handle_token_seen(&mut self, token: u64) {
        self.last_token = self.last_token.max(Some(token));
    }

    /// Our entry exists with `position`.
    pub fn handle_entry_created(&mut self, position: u64) {
        if self.state != CandidateState::Creating {
            // Resigned meanwhile: remove what was just created.
            if self.is_finished() {
                self.actions.push_back(Action::DeleteEntry { position });
            }
            return;
        }
        if self.highest_reached().is_some_and(|last| position <= last) {
            // A healthy backend gives a new entry a position above every token issued before
            // and above every entry of ours before it.
            return self.become_regressed(position);
        }
        self.last_position = Some(position);
        self.become_positioning(position);
    }

    /// The entry ahead of ours, or `None` when ours is the lowest.
    pub fn handle_predecessor(&mut self, predecessor: Option<u64>) {
        let CandidateState::Positioning { own_position } = self.state else {
            return;
        };
        match predecessor {
            None => self.become_leading(own_position),
            // A "predecessor" newer than us can only come from a server that breaks the
            // protocol: never lead on such an answer.
            Some(predecessor) if predecessor >= own_position => {
                self.become_lost(LossReason::BackendFailed, true);
            }
            Some(predecessor) => {
                self.state = CandidateState::Queued {
                    own_position,
                    predecessor,
                };
                self.actions.push_back(Action::WatchPredecessor {
                    position: predecessor,
                });
            }
        }
    }

    /// The predecessor with `position` was deleted: look again (another may now be ahead).
    pub fn handle_predecessor_deleted(&mut self, position: u64) {
        if let CandidateState::Queued {
            own_position,
            predecessor,
        } = self.state
        {
            if predecessor == position {
                self.become_positioning(own_position);
            }
        }
    }

    /// Our own entry was deleted by someone else (or its lease vanished at the server).
    pub fn handle_entry_deleted(&mut self) {
        if self.own_position().is_some() || self.state == CandidateState::Creating {
            self.become_lost(LossReason::EntryDeleted, false);
        }
    }

    /// The lease expired locally or at the server.
    pub fn handle_lease_expired(&mut self) {
        if self.own_position().is_some() || self.state == CandidateState::Creating {
            self.become_lost(LossReason::LeaseExpired, true);
        }
    }

    /// The backend failed beyond retry.
    pub fn handle_backend_failed(&mut self) {
        if !self.is_finished() && self.state != CandidateState::Idle {
            self.become_lost(LossReason::BackendFailed, true);
        }
    }

    // Outputs.

    /// The next thing the driver must do.
    pub fn poll_action(&mut self) -> Option<Action> {
        self.actions.pop_front()
    }

    // Transitions.

    fn become_creating(&mut self) {
        self.state = CandidateState::Creating;
        self.actions.push_back(Action::CreateEntry);
    }

    fn become_positioning(&mut self, own_position: u64) {
        self.state = CandidateState::Positioning { own_position };
        self.actions
            .push_back(Action::FindPredecessor { own_position });
    }

    fn become_leading(&mut self, token: u64) {
        // Checked against the server's answer in `handle_entry_created` (a typed loss there);
        // `last_token` only grows before a create, so here it holds by construction.
        debug_assert!(
            self.last_token.is_none_or(|last| token > last),
            "tokens strictly increase within an election"
        );
        self.last_token = Some(token);
        self.state = CandidateState::Leading { token };
        self.actions.push_back(Action::Elected { token });
    }

    /// Our new entry's position is not above an issued token or an earlier entry of ours:
    /// remove the entry and stop for good, requeue or not (every new entry would get a low token too).
    fn become_regressed(&mut self, position: u64) {
        self.actions.push_back(Action::Lost {
            reason: LossReason::TokenRegressed,
            was_leading: false,
        });
        self.actions.push_back(Action::DeleteEntry { position });
        self.state = CandidateState::Lost(LossReason::TokenRegressed);
    }

    /// `delete_own`: whether our entry may still exist and should be removed.
    fn become_lost(&mut self, reason: LossReason, delete_own: bool) {
        let was_leading = matches!(self.state, CandidateState::Leading { .. });
        let own = self.own_position();
        self.actions.push_back(Action::Lost {
            reason,
            was_leading,
        });
        if let (true, Some(position)) = (delete_own, own) {
            self.actions.push_back(Action::DeleteEntry { position });
        }
        if self.requeue {
            self.become_creating();
        } else {
            self.state = CandidateState::Lost(reason);
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn drain(core: &mut Candidate) -> Vec<Action> {
        std::iter::from_fn(|| core.poll_action()).collect()
    }

    fn leading(token: u64) -> Candidate {
        let mut core = Candidate::new(false);
        core.campaign();
        assert_eq!(drain(&mut core), vec![Action::CreateEntry]);
        core.handle_entry_created(token);
        assert_eq!(
            drain(&mut core),
            vec![Action::FindPredecessor {
                own_position: token
            }]
        );
        core.handle_predecessor(None);
        assert_eq!(drain(&mut core), vec![Action::Elected { token }]);
        core
    }

    #[test]
    fn lowest_entry_leads_at_once() {
        let core = leading(7);
        assert_eq!(core.state(), CandidateState::Leading { token: 7 });
        assert_eq!(core.token(), Some(7));
    }

    #[test]
    fn waiter_watches_only_its_predecessor_and_rechecks_on_deletion() {
        let mut core = Candidate::new(false);
        core.campaign();
        core.handle_entry_created(20);
        drain(&mut core);
        core.handle_predecessor(Some(15));
        assert_eq!(
            drain(&mut core),
            vec![Action::WatchPredecessor { position: 15 }]
        );
        // A deletion of some other key is not ours to act on.
        core.handle_predecessor_deleted(11);
        assert_eq!(drain(&mut core), vec![]);
        core.handle_predecessor_deleted(15);
        assert_eq!(
            drain(&mut core),
            vec![Action::FindPredecessor { own_position: 20 }]
        );
        // A waiter further ahead remains (15 was a waiter that quit): watch it instead.
        core.handle_predecessor(Some(12));
        assert_eq!(
            drain(&mut core),
            vec![Action::WatchPredecessor { position: 12 }]
        );
        core.handle_predecessor_deleted(12);
        drain(&mut core);
        core.handle_predecessor(None);
        assert_eq!(drain(&mut core), vec![Action::Elected { token: 20 }]);
    }

    #[test]
    fn lease_expiry_while_leading_is_a_loss_with_cleanup() {
        let mut core = leading(7);
        core.handle_lease_expired();
        assert_eq!(
            drain(&mut core),
            vec![
                Action::Lost {
                    reason: LossReason::LeaseExpired,
                    was_leading: true
                },
                Action::DeleteEntry { position: 7 }
            ]
        );
        assert_eq!(core.state(), CandidateState::Lost(LossReason::LeaseExpired));
        assert!(core.is_finished());
        // Nothing resurrects it.
        core.handle_predecessor(None);
        core.handle_entry_created(9);
        assert_eq!(drain(&mut core), vec![Action::DeleteEntry { position: 9 }]);
        assert_eq!(core.token(), None);
    }

    #[test]
    fn own_key_deleted_is_a_loud_loss_even_while_queued() {
        let mut core = Candidate::new(false);
        core.campaign();
        core.handle_entry_created(20);
        core.handle_predecessor(Some(15));
        drain(&mut core);
        core.handle_entry_deleted();
        assert_eq!(
            drain(&mut core),
            vec![Action::Lost {
                reason: LossReason::EntryDeleted,
                was_leading: false
            }]
        );
        let mut core = leading(3);
        core.handle_entry_deleted();
        assert_eq!(
            drain(&mut core),
            vec![Action::Lost {
                reason: LossReason::EntryDeleted,
                was_leading: true
            }]
        );
    }

    #[test]
    fn resign_deletes_the_key_without_reporting_loss() {
        let mut core = leading(7);
        core.resign();
        assert_eq!(drain(&mut core), vec![Action::DeleteEntry { position: 7 }]);
        assert_eq!(core.state(), CandidateState::Resigned);
        core.handle_lease_expired();
        assert_eq!(drain(&mut core), vec![]);
    }

    #[test]
    fn resign_while_creating_deletes_the_key_when_it_appears() {
        let mut core = Candidate::new(false);
        core.campaign();
        drain(&mut core);
        core.resign();
        assert_eq!(drain(&mut core), vec![]);
        core.handle_entry_created(30);
        assert_eq!(drain(&mut core), vec![Action::DeleteEntry { position: 30 }]);
    }

    #[test]
    fn requeue_campaigns_again_after_loss_and_tokens_increase() {
        let mut core = Candidate::new(true);
        core.campaign();
        core.handle_entry_created(7);
        core.handle_predecessor(None);
        drain(&mut core);
        core.handle_lease_expired();
        assert_eq!(
            drain(&mut core),
            vec![
                Action::Lost {
                    reason: LossReason::LeaseExpired,
                    was_leading: true
                },
                Action::DeleteEntry { position: 7 },
                Action::CreateEntry
            ]
        );
        assert_eq!(core.state(), CandidateState::Creating);
        core.handle_entry_created(12);
        core.handle_predecessor(Some(9));
        core.handle_predecessor_deleted(9);
        core.handle_predecessor(None);
        assert_eq!(
            drain(&mut core),
            vec![
                Action::FindPredecessor { own_position: 12 },
                Action::WatchPredecessor { position: 9 },
                Action::FindPredecessor { own_position: 12 },
                Action::Elected { token: 12 }
            ]
        );
        // Resign ends the requeue loop.
        core.resign();
        assert_eq!(drain(&mut core), vec![Action::DeleteEntry { position: 12 }]);
        assert!(core.is_finished());
    }

    #[test]
    fn after_stop_requeue_a_step_down_resigns_and_a_loss_is_final() {
        let mut core = Candidate::new(true);
        core.campaign();
        core.handle_entry_created(7);
        core.handle_predecessor(None);
        drain(&mut core);
        core.stop_requeue();
        // The current term goes on.
        assert_eq!(core.state(), CandidateState::Leading { token: 7 });
        core.step_down();
        assert_eq!(drain(&mut core), vec![Action::DeleteEntry { position: 7 }]);
        assert_eq!(core.state(), CandidateState::Resigned);

        let mut core = Candidate::new(true);
        core.campaign();
        core.handle_entry_created(9);
        core.handle_predecessor(None);
        drain(&mut core);
        core.stop_requeue();
        core.handle_entry_deleted();
        assert_eq!(
            drain(&mut core),
            vec![Action::Lost {
                reason: LossReason::EntryDeleted,
                was_leading: true
            }]
        );
        assert!(core.is_finished());
    }

    #[test]
    fn step_down_with_requeue_campaigns_again_and_without_it_resigns() {
        let mut core = Candidate::new(true);
        core.campaign();
        core.handle_entry_created(7);
        core.handle_predecessor(None);
        drain(&mut core);
        core.step_down();
        assert_eq!(
            drain(&mut core),
            vec![Action::DeleteEntry { position: 7 }, Action::CreateEntry]
        );
        assert_eq!(core.state(), CandidateState::Creating);
        // Not leading: nothing to step down from.
        core.step_down();
        assert_eq!(drain(&mut core), vec![]);

        let mut core = leading(3);
        core.step_down();
        assert_eq!(drain(&mut core), vec![Action::DeleteEntry { position: 3 }]);
        assert_eq!(core.state(), CandidateState::Resigned);
    }

    #[test]
    fn backend_failure_while_creating_and_idle() {
        let mut idle = Candidate::new(false);
        idle.handle_backend_failed();
        assert_eq!(drain(&mut idle), vec![]);
        let mut core = Candidate::new(false);
        core.campaign();
        drain(&mut core);
        core.handle_backend_failed();
        assert_eq!(
            drain(&mut core),
            vec![Action::Lost {
                reason: LossReason::BackendFailed,
                was_leading: false
            }]
        );
    }

    #[test]
    fn a_predecessor_newer_than_us_is_a_backend_failure_not_a_panic() {
        let mut core = Candidate::new(false);
        core.campaign();
        core.handle_entry_created(20);
        drain(&mut core);
        core.handle_predecessor(Some(25));
        assert_eq!(
            drain(&mut core),
            vec![
                Action::Lost {
                    reason: LossReason::BackendFailed,
                    was_leading: false
                },
                Action::DeleteEntry { position: 20 }
            ]
        );
        assert_eq!(
            core.state(),
            CandidateState::Lost(LossReason::BackendFailed)
        );
    }

    #[test]
    fn tokens_going_backwards_end_the_candidacy_even_with_requeue() {
        // The backend was wiped or restored while we led with 7: the requeued entry gets 5.
        let mut core = Candidate::new(true);
        core.campaign();
        core.handle_entry_created(7);
        core.handle_predecessor(None);
        core.handle_entry_deleted();
        assert_eq!(
            drain(&mut core),
            vec![
                Action::CreateEntry,
                Action::FindPredecessor { own_position: 7 },
                Action::Elected { token: 7 },
                Action::Lost {
                    reason: LossReason::EntryDeleted,
                    was_leading: true
                },
                Action::CreateEntry
            ]
        );
        core.handle_entry_created(5);
        assert_eq!(
            drain(&mut core),
            vec![
                Action::Lost {
                    reason: LossReason::TokenRegressed,
                    was_leading: false
                },
                Action::DeleteEntry { position: 5 }
            ]
        );
        assert_eq!(
            core.state(),
            CandidateState::Lost(LossReason::TokenRegressed)
        );
        assert!(core.is_finished());
        assert_eq!(core.highest_token(), Some(7));
        // Nothing revives it: a late answer neither elects nor requeues.
        core.handle_predecessor(None);
        core.handle_lease_expired();
        assert_eq!(drain(&mut core), vec![]);
        // An equal position is no increase either.
        let mut core = Candidate::new(true);
        core.handle_token_seen(9);
        core.campaign();
        core.handle_entry_created(9);
        assert_eq!(
            drain(&mut core),
            vec![
                Action::CreateEntry,
                Action::Lost {
                    reason: LossReason::TokenRegressed,
                    was_leading: false
                },
                Action::DeleteEntry { position: 9 }
            ]
        );
    }

    #[test]
    fn a_token_seen_elsewhere_raises_the_floor_and_higher_entries_lead() {
        let mut core = Candidate::new(false);
        core.handle_token_seen(40);
        core.handle_token_seen(12);
        assert_eq!(core.highest_token(), Some(40));
        core.campaign();
        core.handle_entry_created(41);
        core.handle_predecessor(None);
        assert_eq!(
            drain(&mut core),
            vec![
                Action::CreateEntry,
                Action::FindPredecessor { own_position: 41 },
                Action::Elected { token: 41 }
            ]
        );
        assert_eq!(core.highest_token(), Some(41));
    }

    /// A waiter that never led knows no token, but its own entries: after a restore that
    /// takes its entry away, the entry it creates again comes out below the old one, and that
    /// ends the candidacy as a token going backwards would.
    #[test]
    fn a_waiter_whose_new_entry_is_below_its_old_one_regresses() {
        let mut core = Candidate::new(true);
        core.campaign();
        core.handle_entry_created(109);
        core.handle_predecessor(Some(100));
        core.handle_entry_deleted();
        assert_eq!(
            drain(&mut core),
            vec![
                Action::CreateEntry,
                Action::FindPredecessor { own_position: 109 },
                Action::WatchPredecessor { position: 100 },
                Action::Lost {
                    reason: LossReason::EntryDeleted,
                    was_leading: false
                },
                Action::CreateEntry
            ]
        );
        assert_eq!(core.highest_token(), None);
        assert_eq!(core.highest_reached(), Some(109));
        core.handle_entry_created(62);
        assert_eq!(
            drain(&mut core),
            vec![
                Action::Lost {
                    reason: LossReason::TokenRegressed,
                    was_leading: false
                },
                Action::DeleteEntry { position: 62 }
            ]
        );
        assert!(core.is_finished());
        // A healthy backend's next entry is above the old one: it queues again.
        let mut core = Candidate::new(true);
        core.campaign();
        core.handle_entry_created(109);
        core.handle_entry_deleted();
        core.handle_entry_created(110);
        core.handle_predecessor(None);
        assert_eq!(
            drain(&mut core).last(),
            Some(&Action::Elected { token: 110 })
        );
    }
}

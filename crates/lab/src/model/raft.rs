//! Raft-style leader election (Ongaro and Ousterhout, 2014, §5.2), without log replication.
//!
//! Terms number elections. A follower that hears no heartbeat for a randomized election
//! timeout becomes a candidate for the next term, votes for itself and asks the others; each
//! node grants at most one vote per term and *persists that vote before replying* (durable
//! before spoken), so even a crash and restart cannot make it vote twice. A candidate with a
//! majority leads its term. Two majorities of the same cluster always share a node, so no
//! term ever has two leaders. A deposed leader that has not yet heard of the newer term,
//! however, still believes it leads: Raft makes terms unique, not beliefs.
//!
//! Options from the Raft thesis (§9.6): *pre-vote* asks whether an election could succeed
//! before bumping the term, so a node cut off in a minority cannot disrupt the cluster when it
//! returns; *check-quorum* makes a leader step down when it has not heard from a majority for
//! a minimum election timeout, which shortens the time a deposed leader believes it leads.
//! With either option, a node that heard from a live leader within the minimum election
//! timeout ignores vote requests (leader stickiness).
//!
//! The leader's fencing token is its term.

use std::collections::VecDeque;
use std::time::Duration;

use baton_core::Instant;

use super::{Leadership, NodeId, Output, Process};

/// Timing and options of the Raft-style election.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct RaftConfig {
    /// Shortest randomized election timeout.
    pub election_timeout_min: Duration,
    /// Longest randomized election timeout.
    pub election_timeout_max: Duration,
    /// How often the leader sends (empty) heartbeats.
    pub heartbeat_interval: Duration,
    /// Ask for pre-votes before starting a real election.
    pub pre_vote: bool,
    /// Step down as leader without a recent majority.
    pub check_quorum: bool,
}

impl Default for RaftConfig {
    fn default() -> RaftConfig {
        RaftConfig {
            election_timeout_min: Duration::from_millis(750),
            election_timeout_max: Duration::from_millis(1500),
            heartbeat_interval: Duration::from_millis(150),
            pre_vote: false,
            check_quorum: false,
        }
    }
}

/// What a node persists: the current term and its vote in it.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub struct Stable {
    /// The current term.
    pub term: u64,
    /// Whom this node voted for in `term`.
    pub voted_for: Option<NodeId>,
}

/// Raft election messages.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Message {
    /// "Would you vote for me in `term`?" (changes nothing at the receiver).
    PreVote {
        /// The term the sender would campaign in.
        term: u64,
    },
    /// Answer to `PreVote`.
    PreVoteReply {
        /// The term asked about.
        term: u64,
        /// Whether the vote would be granted.
        granted: bool,
    },
    /// "Vote for me in `term`."
    RequestVote {
        /// The candidate's term.
        term: u64,
    },
    /// Answer to `RequestVote`.
    Vote {
        /// The voter's current term.
        term: u64,
        /// Whether the vote was granted.
        granted: bool,
    },
    /// The leader's heartbeat (an empty AppendEntries).
    Heartbeat {
        /// The leader's term.
        term: u64,
    },
    /// Answer to `Heartbeat`.
    HeartbeatReply {
        /// The follower's current term.
        term: u64,
    },
}

/// What the driver must do next.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Action {
    /// Write term and vote to stable storage; later actions may be sent only after it is
    /// durable.
    Persist(Stable),
    /// Send `message` to node `to`.
    Send {
        /// Destination.
        to: NodeId,
        /// The message.
        message: Message,
    },
    /// This node won the election for `term`.
    BecameLeader {
        /// The term.
        term: u64,
    },
    /// This node stopped leading.
    SteppedDown,
}

/// Where a Raft node is.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Role {
    /// Following `leader`, if known.
    Follower {
        /// The leader of the current term, if heard from.
        leader: Option<NodeId>,
    },
    /// Collecting pre-votes for the next term (bit mask of grants, self included).
    PreCandidate {
        /// Grants so far.
        votes: u32,
    },
    /// Collecting votes for the current term.
    Candidate {
        /// Grants so far.
        votes: u32,
    },
    /// Leading the current term.
    Leader,
}

/// One Raft node (election only).
///
/// Call order: [`RaftNode::start`]; then `handle_message` / `handle_timeout` (when
/// [`RaftNode::poll_timeout`] passes), each with a fresh random `entropy` from which election
/// timeouts are drawn; drain [`RaftNode::poll_action`] after each call and perform
/// [`Action::Persist`] before sending anything after it.
#[derive(Debug, Clone)]
pub struct RaftNode {
    id: NodeId,
    nodes: usize,
    config: RaftConfig,
    term: u64,
    voted_for: Option<NodeId>,
    role: Role,
    election_deadline: Instant,
    next_heartbeat: Instant,
    next_quorum_check: Instant,
    last_leader_contact: Option<Instant>,
    /// Leader only: when each peer last answered a heartbeat in this term.
    last_ack: Vec<Option<Instant>>,
    actions: VecDeque<Action>,
}

impl RaftNode {
    /// Node `id` of `nodes`, restarting from `stable` if it persisted anything.
    pub fn new(id: NodeId, nodes: usize, config: RaftConfig, stable: Option<Stable>) -> RaftNode {
        assert!(
            id < nodes && nodes <= super::MAX_NODES,
            "node id out of range"
        );
        let stable = stable.unwrap_or_default();
        RaftNode {
            id,
            nodes,
            config,
            term: stable.term,
            voted_for: stable.voted_for,
            role: Role::Follower { leader: None },
            election_deadline: Instant::ZERO,
            next_heartbeat: Instant::ZERO,
            next_quorum_check: Instant::ZERO,
            last_leader_contact: None,
            last_ack: vec![None; nodes],
            actions: VecDeque::new(),
        }
    }

    // Getters.

    /// The current term.
    pub fn term(&self) -> u64 {
        self.term
    }

    /// The vote cast in the current term.
    pub fn voted_for(&self) -> Option<NodeId> {
        self.voted_for
    }

    /// The current role.
    pub fn role(&self) -> Role {
        self.role
    }

    /// When the election timer fires (followers and candidates).
    pub fn election_deadline(&self) -> Instant {
        self.election_deadline
    }

    // Commands.

    /// Boots as a follower with a randomized election timer.
    pub fn start(&mut self, now: Instant, entropy: u64) {
        self.reset_election_timer(now, entropy);
    }

    // Inputs.

    /// A message from node `from`.
    pub fn handle_message(&mut self, now: Instant, entropy: u64, from: NodeId, message: Message) {
        if from >= self.nodes || from == self.id {
            return;
        }
        match message {
            Message::PreVote { term } => self.on_pre_vote(now, from, term),
            Message::PreVoteReply { term, granted } => {
                self.on_pre_vote_reply(now, entropy, from, term, granted)
            }
            Message::RequestVote { term } => self.on_request_vote(now, entropy, from, term),
            Message::Vote { term, granted } => self.on_vote(now, entropy, from, term, granted),
            Message::Heartbeat { term } => self.on_heartbeat(now, entropy, from, term),
            Message::HeartbeatReply { term } => self.on_heartbeat_reply(now, entropy, from, term),
        }
    }

    /// Time passed.
    pub fn handle_timeout(&mut self, now: Instant, entropy: u64) {
        if self.role == Role::Leader {
            self.leader_tick(now, entropy);
        } else if now >= self.election_deadline {
            if self.config.pre_vote {
                self.become_pre_candidate(now, entropy);
            } else {
                self.become_candidate(now, entropy);
            }
        }
    }

    // Outputs.

    /// The next action.
    pub fn poll_action(&mut self) -> Option<Action> {
        self.actions.pop_front()
    }

    /// When to call [`RaftNode::handle_timeout`].
    pub fn poll_timeout(&self) -> Option<Instant> {
        Some(match self.role {
            Role::Leader if self.config.check_quorum => {
                self.next_heartbeat.min(self.next_quorum_check)
            }
            Role::Leader => self.next_heartbeat,
            _ => self.election_deadline,
        })
    }

    // Handlers.

    fn on_pre_vote(&mut self, now: Instant, from: NodeId, term: u64) {
        let granted =
            term > self.term && self.role != Role::Leader && !self.heard_from_leader_recently(now);
        self.send(from, Message::PreVoteReply { term, granted });
    }

    fn on_pre_vote_reply(
        &mut self,
        now: Instant,
        entropy: u64,
        from: NodeId,
        term: u64,
        granted: bool,
    ) {
        let Role::PreCandidate { votes } = self.role else {
            return;
        };
        if granted && term == self.term + 1 {
            let votes = votes | (1 << from);
            self.role = Role::PreCandidate { votes };
            if self.is_majority(votes) {
                self.become_candidate(now, entropy);
            }
        }
    }

    fn on_request_vote(&mut self, now: Instant, entropy: u64, from: NodeId, term: u64) {
        let sticky = self.config.pre_vote || self.config.check_quorum;
        if sticky && term > self.term && self.heard_from_leader_recently(now) {
            // Leader stickiness: a live leader exists; do not let this candidate disrupt it.
            return;
        }
        if term > self.term {
            self.become_follower(now, entropy, term, None);
        }
        let free = self.voted_for.is_none() || self.voted_for == Some(from);
        let granted = term == self.term && free && matches!(self.role, Role::Follower { .. });
        if granted {
            if self.voted_for != Some(from) {
                self.voted_for = Some(from);
                self.persist();
            }
            self.reset_election_timer(now, entropy);
        }
        self.send(
            from,
            Message::Vote {
                term: self.term,
                granted,
            },
        );
    }

    fn on_vote(&mut self, now: Instant, entropy: u64, from: NodeId, term: u64, granted: bool) {
        if term > self.term {
            self.become_follower(now, entropy, term, None);
            return;
        }
        let Role::Candidate { votes } = self.role else {
            return;
        };
        if granted && term == self.term {
            let votes = votes | (1 << from);
            self.role = Role::Candidate { votes };
            if self.is_majority(votes) {
                self.become_leader(now);
            }
        }
    }

    fn on_heartbeat(&mut self, now: Instant, entropy: u64, from: NodeId, term: u64) {
        if term < self.term {
            // Tell the stale leader about the newer term so it steps down.
            self.send(from, Message::HeartbeatReply { term: self.term });
            return;
        }
        assert!(
            !(self.role == Role::Leader && term == self.term),
            "two leaders in term {term}: {} and {from}",
            self.id
        );
        if term > self.term || self.role != (Role::Follower { leader: Some(from) }) {
            self.become_follower(now, entropy, term, Some(from));
        }
        self.last_leader_contact = Some(now);
        self.reset_election_timer(now, entropy);
        self.send(from, Message::HeartbeatReply { term: self.term });
    }

    fn on_heartbeat_reply(&mut self, now: Instant, entropy: u64, from: NodeId, term: u64) {
        if term > self.term {
            self.become_follower(now, entropy, term, None);
        } else if self.role == Role::Leader && term == self.term {
            self.last_ack[from] = Some(now);
        }
    }

    fn leader_tick(&mut self, now: Instant, entropy: u64) {
        if self.config.check_quorum && now >= self.next_quorum_check {
            let window_start = now
                .as_nanos()
                .saturating_sub(duration_nanos(self.config.election_timeout_min));
            let active = 1 + self
                .last_ack
                .iter()
                .filter(|ack| ack.is_some_and(|at| at.as_nanos() >= window_start))
                .count();
            if active < self.majority() {
                self.become_follower(now, entropy, self.term, None);
                return;
            }
            self.next_quorum_check = now + self.config.election_timeout_min;
        }
        if now >= self.next_heartbeat {
            self.next_heartbeat = now + self.config.heartbeat_interval;
            self.broadcast(Message::Heartbeat { term: self.term });
        }
    }

    // Transitions.

    fn become_pre_candidate(&mut self, now: Instant, entropy: u64) {
        self.step_down_if_leading();
        self.role = Role::PreCandidate {
            votes: 1 << self.id,
        };
        self.reset_election_timer(now, entropy);
        self.broadcast(Message::PreVote {
            term: self.term + 1,
        });
    }

    fn become_candidate(&mut self, now: Instant, entropy: u64) {
        self.step_down_if_leading();
        self.term += 1;
        self.voted_for = Some(self.id);
        self.persist();
        self.role = Role::Candidate {
            votes: 1 << self.id,
        };
        self.reset_election_timer(now, entropy);
        self.broadcast(Message::RequestVote { term: self.term });
    }

    fn become_leader(&mut self, now: Instant) {
        assert_eq!(self.voted_for, Some(self.id), "a leader voted for itself");
        self.role = Role::Leader;
        self.last_ack = vec![None; self.nodes];
        self.next_heartbeat = now + self.config.heartbeat_interval;
        self.next_quorum_check = now + self.config.election_timeout_min;
        self.actions
            .push_back(Action::BecameLeader { term: self.term });
        self.broadcast(Message::Heartbeat { term: self.term });
    }

    fn become_follower(&mut self, now: Instant, entropy: u64, term: u64, leader: Option<NodeId>) {
        assert!(term >= self.term, "the term never decreases");
        self.step_down_if_leading();
        if term > self.term {
            self.term = term;
            self.voted_for = None;
            self.persist();
        }
        self.role = Role::Follower { leader };
        self.reset_election_timer(now, entropy);
    }

    fn step_down_if_leading(&mut self) {
        if self.role == Role::Leader {
            self.actions.push_back(Action::SteppedDown);
        }
    }

    // Helpers.

    fn heard_from_leader_recently(&self, now: Instant) -> bool {
        self.last_leader_contact
            .is_some_and(|at| now < at + self.config.election_timeout_min)
    }

    fn reset_election_timer(&mut self, now: Instant, entropy: u64) {
        let min = duration_nanos(self.config.election_timeout_min);
        let max = duration_nanos(self.config.election_timeout_max).max(min);
        let jitter = entropy % (max - min + 1);
        self.election_deadline = Instant::from_nanos(now.as_nanos().saturating_add(min + jitter));
    }

    fn majority(&self) -> usize {
        self.nodes / 2 + 1
    }

    fn is_majority(&self, votes: u32) -> bool {
        votes.count_ones() as usize >= self.majority()
    }

    fn persist(&mut self) {
        self.actions.push_back(Action::Persist(Stable {
            term: self.term,
            voted_for: self.voted_for,
        }));
    }

    fn broadcast(&mut self, message: Message) {
        let id = self.id;
        for to in (0..self.nodes).filter(|&to| to != id) {
            self.send(to, message);
        }
    }

    fn send(&mut self, to: NodeId, message: Message) {
        self.actions.push_back(Action::Send { to, message });
    }
}

fn duration_nanos(duration: Duration) -> u64 {
    u64::try_from(duration.as_nanos()).unwrap_or(u64::MAX)
}

/// The Raft-style election as a simulator [`super::Algorithm`].
#[derive(Debug, Clone, Copy, Default)]
pub struct Raft {
    /// Timing and options shared by every node.
    pub config: RaftConfig,
}

impl super::Algorithm for Raft {
    type Process = RaftNode;

    fn node(&self, id: NodeId, nodes: usize, stable: Option<&Stable>) -> RaftNode {
        RaftNode::new(id, nodes, self.config, stable.copied())
    }
}

impl Process for RaftNode {
    type Message = Message;
    type Stable = Stable;

    fn start(&mut self, now: Instant, entropy: u64) {
        RaftNode::start(self, now, entropy);
    }

    fn handle_message(&mut self, now: Instant, entropy: u64, from: NodeId, message: Message) {
        RaftNode::handle_message(self, now, entropy, from, message);
    }

    fn handle_timeout(&mut self, now: Instant, entropy: u64) {
        RaftNode::handle_timeout(self, now, entropy);
    }

    fn poll_output(&mut self) -> Option<Output<Message, Stable>> {
        loop {
            match self.poll_action()? {
                Action::Send { to, message } => return Some(Output::Send { to, message }),
                Action::Persist(stable) => return Some(Output::Persist(stable)),
                Action::BecameLeader { .. } | Action::SteppedDown => {}
            }
        }
    }

    fn poll_timeout(&self) -> Option<Instant> {
        RaftNode::poll_timeout(self)
    }

    fn leadership(&self, _now: Instant) -> Option<Leadership> {
        (self.role == Role::Leader).then_some(Leadership {
            token: self.term,
            until: None,
        })
    }

    fn is_election_traffic(message: &Message) -> bool {
        !matches!(
            message,
            Message::Heartbeat { .. } | Message::HeartbeatReply { .. }
        )
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn at(ms: u64) -> Instant {
        Instant::from_millis(ms)
    }

    fn drain(node: &mut RaftNode) -> Vec<Action> {
        std::iter::from_fn(|| node.poll_action()).collect()
    }

    fn send(to: NodeId, message: Message) -> Action {
        Action::Send { to, message }
    }

    fn persist(term: u64, voted_for: Option<NodeId>) -> Action {
        Action::Persist(Stable { term, voted_for })
    }

    /// 750 ms + this much entropy (in nanoseconds) is the election timeout.
    const JITTER_100MS: u64 = 100_000_000;

    fn node(id: NodeId, config: RaftConfig) -> RaftNode {
        let mut node = RaftNode::new(id, 3, config, None);
        node.start(at(0), JITTER_100MS);
        node
    }

    #[test]
    fn election_timeout_is_drawn_from_the_entropy_input() {
        let node = node(0, RaftConfig::default());
        assert_eq!(node.poll_timeout(), Some(at(850)));
        let mut other = RaftNode::new(0, 3, RaftConfig::default(), None);
        other.start(at(0), 0);
        assert_eq!(other.poll_timeout(), Some(at(750)));
        other.start(at(0), 750_000_000);
        assert_eq!(other.poll_timeout(), Some(at(1500)));
    }

    #[test]
    fn timeout_makes_a_candidate_that_persists_before_asking() {
        let mut node = node(0, RaftConfig::default());
        node.handle_timeout(at(850), 0);
        assert_eq!(
            drain(&mut node),
            vec![
                persist(1, Some(0)),
                send(1, Message::RequestVote { term: 1 }),
                send(2, Message::RequestVote { term: 1 }),
            ]
        );
        assert_eq!(node.role(), Role::Candidate { votes: 0b001 });
        node.handle_message(
            at(860),
            0,
            2,
            Message::Vote {
                term: 1,
                granted: true,
            },
        );
        assert_eq!(
            drain(&mut node),
            vec![
                Action::BecameLeader { term: 1 },
                send(1, Message::Heartbeat { term: 1 }),
                send(2, Message::Heartbeat { term: 1 }),
            ]
        );
    }

    #[test]
    fn one_vote_per_term_persisted_before_the_reply() {
        let mut node = node(0, RaftConfig::default());
        node.handle_message(at(10), 0, 1, Message::RequestVote { term: 3 });
        assert_eq!(
            drain(&mut node),
            vec![
                persist(3, None),
                persist(3, Some(1)),
                send(
                    1,
                    Message::Vote {
                        term: 3,
                        granted: true
                    }
                ),
            ]
        );
        // The same candidate asking again gets the same answer, without a new write.
        node.handle_message(at(11), 0, 1, Message::RequestVote { term: 3 });
        assert_eq!(
            drain(&mut node),
            vec![send(
                1,
                Message::Vote {
                    term: 3,
                    granted: true
                }
            )]
        );
        // A rival in the same term is refused.
        node.handle_message(at(12), 0, 2, Message::RequestVote { term: 3 });
        assert_eq!(
            drain(&mut node),
            vec![send(
                2,
                Message::Vote {
                    term: 3,
                    granted: false
                }
            )]
        );
        // After a restart from stable storage the vote still holds.
        let mut restarted = RaftNode::new(
            0,
            3,
            RaftConfig::default(),
            Some(Stable {
                term: 3,
                voted_for: Some(1),
            }),
        );
        restarted.start(at(20), 0);
        restarted.handle_message(at(21), 0, 2, Message::RequestVote { term: 3 });
        assert_eq!(
            drain(&mut restarted),
            vec![send(
                2,
                Message::Vote {
                    term: 3,
                    granted: false
                }
            )]
        );
    }

    #[test]
    fn stale_leader_learns_the_newer_term_and_steps_down() {
        let mut node = leader(RaftConfig::default());
        // Until someone tells it, it still believes it leads: heartbeats go out.
        node.handle_timeout(at(1010), 0);
        assert_eq!(
            drain(&mut node),
            vec![
                send(1, Message::Heartbeat { term: 1 }),
                send(2, Message::Heartbeat { term: 1 }),
            ]
        );
        node.handle_message(at(1020), 0, 2, Message::HeartbeatReply { term: 4 });
        assert_eq!(
            drain(&mut node),
            vec![Action::SteppedDown, persist(4, None)]
        );
        assert_eq!(node.role(), Role::Follower { leader: None });
        // A heartbeat from the old term is answered with the new term.
        node.handle_message(at(1030), 0, 1, Message::Heartbeat { term: 2 });
        assert_eq!(
            drain(&mut node),
            vec![send(1, Message::HeartbeatReply { term: 4 })]
        );
    }

    #[test]
    fn pre_vote_does_not_bump_the_term_until_a_majority_agrees() {
        let config = RaftConfig {
            pre_vote: true,
            ..RaftConfig::default()
        };
        let mut node = node(0, config);
        node.handle_timeout(at(850), 0);
        assert_eq!(
            drain(&mut node),
            vec![
                send(1, Message::PreVote { term: 1 }),
                send(2, Message::PreVote { term: 1 }),
            ]
        );
        assert_eq!(node.term(), 0);
        node.handle_message(
            at(860),
            0,
            1,
            Message::PreVoteReply {
                term: 1,
                granted: false,
            },
        );
        assert_eq!(drain(&mut node), vec![]);
        node.handle_message(
            at(861),
            0,
            2,
            Message::PreVoteReply {
                term: 1,
                granted: true,
            },
        );
        assert_eq!(
            drain(&mut node),
            vec![
                persist(1, Some(0)),
                send(1, Message::RequestVote { term: 1 }),
                send(2, Message::RequestVote { term: 1 }),
            ]
        );
        // A node that heard from its leader recently refuses pre-votes and ignores requests.
        let mut follower = node_following(config);
        follower.handle_message(at(120), 0, 2, Message::PreVote { term: 6 });
        assert_eq!(
            drain(&mut follower),
            vec![send(
                2,
                Message::PreVoteReply {
                    term: 6,
                    granted: false
                }
            )]
        );
        follower.handle_message(at(130), 0, 2, Message::RequestVote { term: 6 });
        assert_eq!(drain(&mut follower), vec![]);
        assert_eq!(follower.term(), 5);
    }

    /// Node 0, elected in term 1 by node 1's vote at 860 ms, its actions drained.
    fn leader(config: RaftConfig) -> RaftNode {
        let mut node = node(0, config);
        node.handle_timeout(at(850), 0);
        node.handle_message(
            at(860),
            0,
            1,
            Message::Vote {
                term: 1,
                granted: true,
            },
        );
        drain(&mut node);
        assert_eq!(node.role(), Role::Leader);
        node
    }

    fn node_following(config: RaftConfig) -> RaftNode {
        let mut node = node(1, config);
        node.handle_message(at(100), 0, 0, Message::Heartbeat { term: 5 });
        assert_eq!(
            drain(&mut node),
            vec![
                persist(5, None),
                send(0, Message::HeartbeatReply { term: 5 })
            ]
        );
        node
    }

    #[test]
    fn check_quorum_steps_down_without_a_majority() {
        let config = RaftConfig {
            check_quorum: true,
            ..RaftConfig::default()
        };
        let mut node = leader(config);
        assert_eq!(node.poll_timeout(), Some(at(1010)));
        // Node 1 answers for a while, then everyone goes silent.
        node.handle_message(at(900), 0, 1, Message::HeartbeatReply { term: 1 });
        node.handle_timeout(at(1610), 0);
        assert_eq!(node.role(), Role::Leader);
        drain(&mut node);
        node.handle_timeout(at(2360), 0);
        assert_eq!(drain(&mut node), vec![Action::SteppedDown]);
        assert_eq!(node.role(), Role::Follower { leader: None });
        assert_eq!(node.term(), 1);
    }

    #[test]
    #[should_panic(expected = "two leaders in term")]
    fn a_second_leader_in_the_same_term_is_a_bug() {
        let mut node = leader(RaftConfig::default());
        node.handle_message(at(870), 0, 2, Message::Heartbeat { term: 1 });
    }
}

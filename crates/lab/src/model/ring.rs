//! The ring algorithm (Chang and Roberts, 1979, with LeLann's id collection): an `Election`
//! message travels a logical ring collecting ids; when it returns to its initiator the highest
//! id collected is the leader, and a `Coordinator` message makes a second lap to announce it.
//!
//! Ring repair: every ring message must be acknowledged by the successor within
//! `ack_timeout`; otherwise the successor is suspected (for `suspicion_ttl`) and the message
//! goes to the next node instead. A node that is alone on its ring elects itself. Like bully,
//! failure detection is by timeouts only, so each side of a partition repairs its own ring and
//! elects its own leader. Two leaders that hear each other's heartbeats settle by
//! (epoch, id): the lower steps down.
//!
//! The leader's fencing token is the election epoch: one more than the highest epoch the
//! election message saw on its lap.

use std::collections::VecDeque;
use std::time::Duration;

use baton_core::Instant;

use super::{highest_member, Leadership, NodeId, Output, Process};

/// Unacknowledged ring messages kept for retransmission; older ones are dropped (a stuck
/// election is restarted by `election_timeout` anyway).
const MAX_PENDING: usize = 16;

/// Timing of the ring algorithm.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct RingConfig {
    /// How long the successor has to acknowledge a ring message before it is skipped.
    pub ack_timeout: Duration,
    /// How long a suspected node is skipped before it is tried again.
    pub suspicion_ttl: Duration,
    /// How often the leader tells everyone it is alive.
    pub heartbeat_interval: Duration,
    /// Silence from the leader after which a node starts an election.
    pub failure_timeout: Duration,
    /// An election not concluded by a `Coordinator` within this time is started again.
    pub election_timeout: Duration,
}

impl Default for RingConfig {
    fn default() -> RingConfig {
        RingConfig {
            ack_timeout: Duration::from_millis(100),
            suspicion_ttl: Duration::from_secs(2),
            heartbeat_interval: Duration::from_millis(150),
            failure_timeout: Duration::from_millis(750),
            election_timeout: Duration::from_millis(1000),
        }
    }
}

/// What travels around the ring.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Circulating {
    /// Collects the ids of live nodes.
    Election {
        /// Who started this lap.
        initiator: NodeId,
        /// Ids collected so far (bit mask).
        ids: u32,
        /// Highest epoch seen on the lap.
        max_epoch: u64,
    },
    /// Announces the winner.
    Coordinator {
        /// Who started this lap.
        initiator: NodeId,
        /// The winner.
        leader: NodeId,
        /// The winner's epoch (its fencing token).
        epoch: u64,
        /// Nodes that have seen this announcement (bit mask).
        visited: u32,
    },
}

/// Ring messages.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Message {
    /// A ring message, to be acknowledged with `Ack { seq }`.
    Ring {
        /// The sender's sequence number for acknowledgement.
        seq: u64,
        /// The content.
        circulating: Circulating,
    },
    /// "I received your ring message `seq`."
    Ack {
        /// The acknowledged sequence number.
        seq: u64,
    },
    /// The leader's periodic liveness signal, sent directly to every node.
    Heartbeat {
        /// The leader's epoch.
        epoch: u64,
    },
}

/// What the driver must do next.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Action {
    /// Send `message` to node `to`.
    Send {
        /// Destination.
        to: NodeId,
        /// The message.
        message: Message,
    },
    /// This node became leader (or learned a newer epoch for its leadership).
    BecameLeader {
        /// The election epoch.
        epoch: u64,
    },
    /// This node stopped being leader.
    SteppedDown,
}

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
struct Pending {
    seq: u64,
    to: NodeId,
    circulating: Circulating,
    deadline: Instant,
}

/// One ring node.
///
/// Call order: [`RingNode::start`]; then `handle_message` / `handle_timeout` (when
/// [`RingNode::poll_timeout`] passes); drain [`RingNode::poll_action`] after each call.
#[derive(Debug, Clone)]
pub struct RingNode {
    id: NodeId,
    nodes: usize,
    config: RingConfig,
    epoch: u64,
    leader: Option<NodeId>,
    /// While leading: the epoch this node was elected in (its token). Later epochs it hears of
    /// do not change it; only a newer election naming it again does.
    leading: Option<u64>,
    last_heard: Instant,
    next_heartbeat: Instant,
    /// While taking part in an election: when to give up on it and start another.
    participating_until: Option<Instant>,
    suspected_until: Vec<Option<Instant>>,
    pending: VecDeque<Pending>,
    next_seq: u64,
    actions: VecDeque<Action>,
}

impl RingNode {
    /// Node `id` of `nodes`.
    pub fn new(id: NodeId, nodes: usize, config: RingConfig) -> RingNode {
        assert!(
            id < nodes && nodes <= super::MAX_NODES,
            "node id out of range"
        );
        RingNode {
            id,
            nodes,
            config,
            epoch: 0,
            leader: None,
            leading: None,
            last_heard: Instant::ZERO,
            next_heartbeat: Instant::ZERO,
            participating_until: None,
            suspected_until: vec![None; nodes],
            pending: VecDeque::new(),
            next_seq: 0,
            actions: VecDeque::new(),
        }
    }

    // Getters.

    /// The leader this node follows (itself when leading).
    pub fn leader(&self) -> Option<NodeId> {
        self.leader
    }

    /// The token while leading.
    pub fn leader_epoch(&self) -> Option<u64> {
        self.leading
    }

    /// Whether `node` is currently skipped as suspected at `now`.
    pub fn is_suspected(&self, now: Instant, node: NodeId) -> bool {
        self.suspected_until
            .get(node)
            .copied()
            .flatten()
            .is_some_and(|until| now < until)
    }

    // Commands.

    /// Boots: a (re)starting node holds an election to find the leader.
    pub fn start(&mut self, now: Instant) {
        self.last_heard = now;
        self.start_election(now);
    }

    // Inputs.

    /// A message from node `from`.
    pub fn handle_message(&mut self, now: Instant, from: NodeId, message: Message) {
        if from >= self.nodes || from == self.id {
            return;
        }
        self.suspected_until[from] = None;
        match message {
            Message::Ring { seq, circulating } => {
                self.send(from, Message::Ack { seq });
                match circulating {
                    Circulating::Election {
                        initiator,
                        ids,
                        max_epoch,
                    } => self.on_election(now, initiator, ids, max_epoch),
                    Circulating::Coordinator {
                        initiator,
                        leader,
                        epoch,
                        visited,
                    } => self.on_coordinator(now, initiator, leader, epoch, visited),
                }
            }
            Message::Ack { seq } => self.pending.retain(|pending| pending.seq != seq),
            Message::Heartbeat { epoch } => self.on_heartbeat(now, from, epoch),
        }
    }

    /// Time passed.
    pub fn handle_timeout(&mut self, now: Instant) {
        while let Some(index) = self.pending.iter().position(|p| now >= p.deadline) {
            let expired = self.pending.remove(index).expect("index is in range");
            self.suspected_until[expired.to] = Some(now + self.config.suspicion_ttl);
            self.forward(now, expired.circulating);
        }
        if let Some(token) = self.leading {
            if now >= self.next_heartbeat {
                self.next_heartbeat = now + self.config.heartbeat_interval;
                self.broadcast(Message::Heartbeat { epoch: token });
            }
        } else if now >= self.last_heard + self.config.failure_timeout {
            self.last_heard = now;
            self.start_election(now);
        }
        if self.participating_until.is_some_and(|until| now >= until) {
            self.participating_until = None;
            self.start_election(now);
        }
    }

    // Outputs.

    /// The next action.
    pub fn poll_action(&mut self) -> Option<Action> {
        self.actions.pop_front()
    }

    /// When to call [`RingNode::handle_timeout`].
    pub fn poll_timeout(&self) -> Option<Instant> {
        let role = if self.leading.is_some() {
            self.next_heartbeat
        } else {
            self.last_heard + self.config.failure_timeout
        };
        let pending = self.pending.iter().map(|p| p.deadline).min();
        [Some(role), pending, self.participating_until]
            .into_iter()
            .flatten()
            .min()
    }

    // Handlers.

    fn on_election(&mut self, now: Instant, initiator: NodeId, ids: u32, max_epoch: u64) {
        self.epoch = self.epoch.max(max_epoch);
        if initiator == self.id || ids & (1 << self.id) != 0 {
            // Back at the start (or the initiator died and the lap came round to us again):
            // the lap is complete.
            self.complete_election(now, ids | (1 << self.id));
            return;
        }
        let participating = self.participating_until.is_some_and(|until| now < until);
        if participating && initiator < self.id {
            // Chang-Roberts: a lap from a lower initiator is redundant while ours (or a higher
            // one we forwarded) is travelling.
            return;
        }
        self.participating_until = Some(now + self.config.election_timeout);
        self.forward(
            now,
            Circulating::Election {
                initiator,
                ids: ids | (1 << self.id),
                max_epoch: self.epoch,
            },
        );
    }

    fn on_coordinator(
        &mut self,
        now: Instant,
        initiator: NodeId,
        leader: NodeId,
        epoch: u64,
        visited: u32,
    ) {
        if initiator == self.id || visited & (1 << self.id) != 0 {
            return;
        }
        self.apply_coordinator(now, leader, epoch);
        self.forward(
            now,
            Circulating::Coordinator {
                initiator,
                leader,
                epoch,
                visited: visited | (1 << self.id),
            },
        );
    }

    fn on_heartbeat(&mut self, now: Instant, from: NodeId, epoch: u64) {
        if self.leader == Some(from) && self.leading.is_none() {
            self.epoch = self.epoch.max(epoch);
            self.last_heard = now;
            return;
        }
        let ours = (
            self.leading.unwrap_or(self.epoch),
            self.leader.map_or(0, |leader| leader + 1),
        );
        if (epoch, from + 1) > ours {
            self.apply_coordinator(now, from, epoch);
        }
    }

    // Transitions.

    fn start_election(&mut self, now: Instant) {
        if self.participating_until.is_some_and(|until| now < until) {
            return;
        }
        self.participating_until = Some(now + self.config.election_timeout);
        self.forward(
            now,
            Circulating::Election {
                initiator: self.id,
                ids: 1 << self.id,
                max_epoch: self.epoch,
            },
        );
    }

    fn complete_election(&mut self, now: Instant, ids: u32) {
        let leader = highest_member(ids).expect("the completing node is in the set");
        self.epoch += 1;
        let epoch = self.epoch;
        self.apply_coordinator(now, leader, epoch);
        self.forward(
            now,
            Circulating::Coordinator {
                initiator: self.id,
                leader,
                epoch,
                visited: 1 << self.id,
            },
        );
    }

    fn apply_coordinator(&mut self, now: Instant, leader: NodeId, epoch: u64) {
        if epoch < self.epoch {
            return;
        }
        self.epoch = epoch;
        self.leader = Some(leader);
        self.participating_until = None;
        self.last_heard = now;
        if leader == self.id {
            self.leading = Some(epoch);
            self.next_heartbeat = now + self.config.heartbeat_interval;
            self.actions.push_back(Action::BecameLeader { epoch });
            self.broadcast(Message::Heartbeat { epoch });
        } else if self.leading.take().is_some() {
            self.actions.push_back(Action::SteppedDown);
        }
    }

    /// Sends `circulating` to the first unsuspected successor, or completes it locally when
    /// this node is alone on its ring.
    fn forward(&mut self, now: Instant, circulating: Circulating) {
        let successor = (1..self.nodes)
            .map(|step| (self.id + step) % self.nodes)
            .find(|&node| !self.is_suspected(now, node));
        let Some(to) = successor else {
            if let Circulating::Election { ids, .. } = circulating {
                self.complete_election(now, ids | (1 << self.id));
            }
            return;
        };
        let seq = self.next_seq;
        self.next_seq += 1;
        if self.pending.len() == MAX_PENDING {
            self.pending.pop_front();
        }
        self.pending.push_back(Pending {
            seq,
            to,
            circulating,
            deadline: now + self.config.ack_timeout,
        });
        self.send(to, Message::Ring { seq, circulating });
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

textbook_model!(
    /// The ring algorithm as a simulator [`super::Algorithm`].
    Ring,
    RingNode,
    RingConfig
);

#[cfg(test)]
mod tests {
    use super::*;

    fn at(ms: u64) -> Instant {
        Instant::from_millis(ms)
    }

    fn drain(node: &mut RingNode) -> Vec<Action> {
        std::iter::from_fn(|| node.poll_action()).collect()
    }

    fn ring(seq: u64, circulating: Circulating) -> Message {
        Message::Ring { seq, circulating }
    }

    fn send(to: NodeId, message: Message) -> Action {
        Action::Send { to, message }
    }

    fn election(initiator: NodeId, ids: u32, max_epoch: u64) -> Circulating {
        Circulating::Election {
            initiator,
            ids,
            max_epoch,
        }
    }

    fn coordinator(initiator: NodeId, leader: NodeId, epoch: u64, visited: u32) -> Circulating {
        Circulating::Coordinator {
            initiator,
            leader,
            epoch,
            visited,
        }
    }

    #[test]
    fn election_goes_to_the_successor_which_adds_itself() {
        let mut node = RingNode::new(1, 3, RingConfig::default());
        node.start(at(0));
        assert_eq!(
            drain(&mut node),
            vec![send(2, ring(0, election(1, 0b010, 0)))]
        );
        node.handle_message(at(5), 2, Message::Ack { seq: 0 });
        // Node 0 initiated a lap that reaches us: we are participating already but 0 < 1,
        // so the redundant lap is swallowed after acknowledging it.
        node.handle_message(at(6), 0, ring(9, election(0, 0b001, 0)));
        assert_eq!(drain(&mut node), vec![send(0, Message::Ack { seq: 9 })]);
        // A higher initiator's lap is forwarded with our id added.
        node.handle_message(at(7), 0, ring(10, election(2, 0b101, 3)));
        assert_eq!(
            drain(&mut node),
            vec![
                send(0, Message::Ack { seq: 10 }),
                send(2, ring(1, election(2, 0b111, 3)))
            ]
        );
    }

    #[test]
    fn completed_lap_elects_the_highest_and_announces_it() {
        let mut node = RingNode::new(0, 3, RingConfig::default());
        node.start(at(0));
        drain(&mut node);
        node.handle_message(at(10), 2, ring(4, election(0, 0b111, 2)));
        assert_eq!(
            drain(&mut node),
            vec![
                send(2, Message::Ack { seq: 4 }),
                send(1, ring(1, coordinator(0, 2, 3, 0b001)))
            ]
        );
        assert_eq!(node.leader(), Some(2));
        assert_eq!(node.leader_epoch(), None);
    }

    #[test]
    fn announced_leader_starts_leading_and_heartbeats() {
        let mut node = RingNode::new(2, 3, RingConfig::default());
        node.handle_message(at(10), 1, ring(7, coordinator(0, 2, 3, 0b011)));
        assert_eq!(
            drain(&mut node),
            vec![
                send(1, Message::Ack { seq: 7 }),
                Action::BecameLeader { epoch: 3 },
                send(0, Message::Heartbeat { epoch: 3 }),
                send(1, Message::Heartbeat { epoch: 3 }),
                // The announcement goes on to node 0, its initiator, which will stop it.
                send(0, ring(0, coordinator(0, 2, 3, 0b111))),
            ]
        );
        assert_eq!(node.leader_epoch(), Some(3));
        // The acknowledgement deadline comes before the first heartbeat.
        assert_eq!(node.poll_timeout(), Some(at(110)));
    }

    #[test]
    fn ring_repair_skips_a_silent_successor() {
        let mut node = RingNode::new(0, 3, RingConfig::default());
        node.start(at(0));
        assert_eq!(
            drain(&mut node),
            vec![send(1, ring(0, election(0, 0b001, 0)))]
        );
        assert_eq!(node.poll_timeout(), Some(at(100)));
        node.handle_timeout(at(100));
        assert_eq!(
            drain(&mut node),
            vec![send(2, ring(1, election(0, 0b001, 0)))]
        );
        assert!(node.is_suspected(at(100), 1));
        // Everyone else silent too: alone on the ring, the node elects itself.
        node.handle_timeout(at(200));
        assert_eq!(
            drain(&mut node),
            vec![
                Action::BecameLeader { epoch: 1 },
                send(1, Message::Heartbeat { epoch: 1 }),
                send(2, Message::Heartbeat { epoch: 1 }),
            ]
        );
        // Hearing from node 1 lifts the suspicion.
        node.handle_message(at(300), 1, Message::Ack { seq: 99 });
        assert!(!node.is_suspected(at(300), 1));
    }

    #[test]
    fn two_leaders_settle_by_epoch_then_id() {
        let mut node = RingNode::new(1, 3, RingConfig::default());
        node.handle_message(at(0), 0, ring(0, election(1, 0b011, 4)));
        drain(&mut node);
        assert_eq!(node.leader_epoch(), Some(5));
        // A heartbeat from a leader with a lower epoch is ignored.
        node.handle_message(at(10), 2, Message::Heartbeat { epoch: 4 });
        assert_eq!(drain(&mut node), vec![]);
        // A higher epoch deposes us.
        node.handle_message(at(20), 2, Message::Heartbeat { epoch: 6 });
        assert_eq!(drain(&mut node), vec![Action::SteppedDown]);
        assert_eq!(node.leader(), Some(2));
    }
}

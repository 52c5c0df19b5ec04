//! The bully algorithm (Garcia-Molina, 1982): the highest live id wins.
//!
//! A node that suspects the coordinator (no heartbeat for `failure_timeout`) sends `Election`
//! to every higher id. Any higher node that is alive answers and takes over the election; if
//! nobody answers within `answer_timeout` the node declares itself coordinator and tells
//! everyone. A node that hears of a *lower* coordinator bullies it by starting an election it
//! will win. Failure detection is by timeouts alone, so a node cut off from the higher ids
//! concludes they are dead: each side of a partition elects its own coordinator.
//!
//! The coordinator's fencing token is its *election epoch*: one more than the highest epoch it
//! has heard of. Epochs order coordinators that heard of each other, and nothing else: two
//! sides of a partition can reach the same epoch.

use std::collections::VecDeque;
use std::time::Duration;

use baton_core::Instant;

use super::{Leadership, NodeId, Output, Process};

/// Timing of the bully algorithm.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct BullyConfig {
    /// How long to wait for an `Answer` from a higher node before declaring victory.
    pub answer_timeout: Duration,
    /// After an `Answer`, how long to wait for the winner's `Coordinator` before retrying.
    pub coordinator_timeout: Duration,
    /// How often the coordinator tells everyone it is alive.
    pub heartbeat_interval: Duration,
    /// Silence from the coordinator after which a node starts an election.
    pub failure_timeout: Duration,
}

impl Default for BullyConfig {
    fn default() -> BullyConfig {
        BullyConfig {
            answer_timeout: Duration::from_millis(200),
            coordinator_timeout: Duration::from_millis(500),
            heartbeat_interval: Duration::from_millis(150),
            failure_timeout: Duration::from_millis(750),
        }
    }
}

/// Bully messages.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Message {
    /// "I am holding an election; any higher node that is alive, answer."
    Election,
    /// "I am alive and higher than you: I take over."
    Answer,
    /// "I am the coordinator of this epoch."
    Coordinator {
        /// The coordinator's election epoch (its fencing token).
        epoch: u64,
    },
    /// The coordinator's periodic liveness signal.
    Heartbeat {
        /// The coordinator's election epoch.
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
    /// This node became coordinator with `epoch` as its token.
    BecameLeader {
        /// The election epoch.
        epoch: u64,
    },
    /// This node stopped being coordinator.
    SteppedDown,
}

/// Where a bully node is.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Role {
    /// Following `leader` (if known), last heard from at `last_heard`.
    Follower {
        /// The coordinator, if known.
        leader: Option<NodeId>,
        /// When it was last heard from.
        last_heard: Instant,
    },
    /// Sent `Election` to the higher ids; waiting for an `Answer` until `deadline`.
    Electing {
        /// When silence means victory.
        deadline: Instant,
    },
    /// A higher node answered; waiting for its `Coordinator` until `deadline`.
    AwaitingCoordinator {
        /// When to give up and start over.
        deadline: Instant,
    },
    /// Coordinator.
    Leader {
        /// When the next heartbeat is due.
        next_heartbeat: Instant,
    },
}

/// One bully node.
///
/// Call order: [`BullyNode::start`]; then `handle_message` / `handle_timeout` (when
/// [`BullyNode::poll_timeout`] passes); drain [`BullyNode::poll_action`] after each call.
#[derive(Debug, Clone)]
pub struct BullyNode {
    id: NodeId,
    nodes: usize,
    config: BullyConfig,
    role: Role,
    /// The highest election epoch heard of; a new coordinator takes one more.
    epoch: u64,
    /// While coordinator: the epoch it was elected in, its token. Epochs heard of later do
    /// not change it.
    token: u64,
    actions: VecDeque<Action>,
}

impl BullyNode {
    /// Node `id` of `nodes`.
    pub fn new(id: NodeId, nodes: usize, config: BullyConfig) -> BullyNode {
        assert!(
            id < nodes && nodes <= super::MAX_NODES,
            "node id out of range"
        );
        BullyNode {
            id,
            nodes,
            config,
            role: Role::Follower {
                leader: None,
                last_heard: Instant::ZERO,
            },
            epoch: 0,
            token: 0,
            actions: VecDeque::new(),
        }
    }

    // Getters.

    /// The current role.
    pub fn role(&self) -> Role {
        self.role
    }

    /// The highest epoch heard of.
    pub fn epoch(&self) -> u64 {
        self.epoch
    }

    // Commands.

    /// Boots: a (re)starting node holds an election, as the algorithm prescribes.
    pub fn start(&mut self, now: Instant) {
        self.start_election(now);
    }

    // Inputs.

    /// A message from node `from`.
    pub fn handle_message(&mut self, now: Instant, from: NodeId, message: Message) {
        if from >= self.nodes || from == self.id {
            return;
        }
        match message {
            Message::Election => self.on_election(now, from),
            Message::Answer => self.on_answer(now, from),
            Message::Coordinator { epoch } => self.on_coordinator(now, from, epoch),
            Message::Heartbeat { epoch } => self.on_heartbeat(now, from, epoch),
        }
    }

    /// Time passed.
    pub fn handle_timeout(&mut self, now: Instant) {
        match self.role {
            Role::Follower { last_heard, .. } => {
                if now >= last_heard + self.config.failure_timeout {
                    self.start_election(now);
                }
            }
            Role::Electing { deadline } => {
                if now >= deadline {
                    self.become_leader(now);
                }
            }
            Role::AwaitingCoordinator { deadline } => {
                if now >= deadline {
                    self.start_election(now);
                }
            }
            Role::Leader { next_heartbeat } => {
                if now >= next_heartbeat {
                    self.role = Role::Leader {
                        next_heartbeat: now + self.config.heartbeat_interval,
                    };
                    self.broadcast(Message::Heartbeat { epoch: self.token });
                }
            }
        }
    }

    // Outputs.

    /// The next action.
    pub fn poll_action(&mut self) -> Option<Action> {
        self.actions.pop_front()
    }

    /// When to call [`BullyNode::handle_timeout`].
    pub fn poll_timeout(&self) -> Option<Instant> {
        Some(match self.role {
            Role::Follower { last_heard, .. } => last_heard + self.config.failure_timeout,
            Role::Electing { deadline } | Role::AwaitingCoordinator { deadline } => deadline,
            Role::Leader { next_heartbeat } => next_heartbeat,
        })
    }

    /// The token while coordinator.
    pub fn leader_epoch(&self) -> Option<u64> {
        matches!(self.role, Role::Leader { .. }).then_some(self.token)
    }

    // Message handlers.

    fn on_election(&mut self, now: Instant, from: NodeId) {
        if from > self.id {
            // Only lower nodes ask us; a higher one would not. Ignore nonsense.
            return;
        }
        self.send(from, Message::Answer);
        match self.role {
            Role::Leader { .. } => self.send(from, Message::Coordinator { epoch: self.token }),
            Role::Follower { .. } => self.start_election(now),
            Role::Electing { .. } | Role::AwaitingCoordinator { .. } => {}
        }
    }

    fn on_answer(&mut self, now: Instant, from: NodeId) {
        if from > self.id && matches!(self.role, Role::Electing { .. }) {
            self.role = Role::AwaitingCoordinator {
                deadline: now + self.config.coordinator_timeout,
            };
        }
    }

    fn on_coordinator(&mut self, now: Instant, from: NodeId, epoch: u64) {
        self.epoch = self.epoch.max(epoch);
        if from > self.id {
            self.become_follower(now, from);
        } else if matches!(self.role, Role::Leader { .. }) {
            // A lower node thinks it leads: remind it.
            self.send(from, Message::Coordinator { epoch: self.token });
        } else {
            // Bully: a lower coordinator while we are alive; take over.
            self.start_election(now);
        }
    }

    fn on_heartbeat(&mut self, now: Instant, from: NodeId, epoch: u64) {
        self.epoch = self.epoch.max(epoch);
        if from > self.id {
            self.become_follower(now, from);
        } else if matches!(self.role, Role::Leader { .. }) {
            self.send(from, Message::Coordinator { epoch: self.token });
        } else if matches!(self.role, Role::Follower { .. }) {
            self.start_election(now);
        }
    }

    // Transitions.

    fn start_election(&mut self, now: Instant) {
        if self.id + 1 == self.nodes {
            self.become_leader(now);
            return;
        }
        self.step_down_if_leading();
        for to in self.id + 1..self.nodes {
            self.send(to, Message::Election);
        }
        self.role = Role::Electing {
            deadline: now + self.config.answer_timeout,
        };
    }

    fn become_leader(&mut self, now: Instant) {
        if matches!(self.role, Role::Leader { .. }) {
            return;
        }
        let before = self.epoch;
        self.epoch += 1;
        assert!(self.epoch > before, "a new coordinator's epoch increases");
        self.token = self.epoch;
        self.role = Role::Leader {
            next_heartbeat: now + self.config.heartbeat_interval,
        };
        self.actions
            .push_back(Action::BecameLeader { epoch: self.epoch });
        self.broadcast(Message::Coordinator { epoch: self.epoch });
    }

    fn become_follower(&mut self, now: Instant, leader: NodeId) {
        self.step_down_if_leading();
        self.role = Role::Follower {
            leader: Some(leader),
            last_heard: now,
        };
    }

    fn step_down_if_leading(&mut self) {
        if matches!(self.role, Role::Leader { .. }) {
            self.actions.push_back(Action::SteppedDown);
        }
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
    /// The bully algorithm as a simulator [`super::Algorithm`].
    Bully,
    BullyNode,
    BullyConfig
);

#[cfg(test)]
mod tests {
    use super::*;

    fn at(ms: u64) -> Instant {
        Instant::from_millis(ms)
    }

    fn drain(node: &mut BullyNode) -> Vec<Action> {
        std::iter::from_fn(|| node.poll_action()).collect()
    }

    fn send(to: NodeId, message: Message) -> Action {
        Action::Send { to, message }
    }

    #[test]
    fn highest_node_wins_at_once_on_boot() {
        let mut node = BullyNode::new(2, 3, BullyConfig::default());
        node.start(at(0));
        assert_eq!(
            drain(&mut node),
            vec![
                Action::BecameLeader { epoch: 1 },
                send(0, Message::Coordinator { epoch: 1 }),
                send(1, Message::Coordinator { epoch: 1 }),
            ]
        );
        assert_eq!(node.poll_timeout(), Some(at(150)));
        node.handle_timeout(at(150));
        assert_eq!(
            drain(&mut node),
            vec![
                send(0, Message::Heartbeat { epoch: 1 }),
                send(1, Message::Heartbeat { epoch: 1 }),
            ]
        );
    }

    #[test]
    fn lower_node_asks_higher_ones_and_wins_when_nobody_answers() {
        let mut node = BullyNode::new(0, 3, BullyConfig::default());
        node.start(at(0));
        assert_eq!(
            drain(&mut node),
            vec![send(1, Message::Election), send(2, Message::Election)]
        );
        assert_eq!(node.poll_timeout(), Some(at(200)));
        node.handle_timeout(at(199));
        assert_eq!(drain(&mut node), vec![]);
        node.handle_timeout(at(200));
        assert_eq!(
            drain(&mut node),
            vec![
                Action::BecameLeader { epoch: 1 },
                send(1, Message::Coordinator { epoch: 1 }),
                send(2, Message::Coordinator { epoch: 1 }),
            ]
        );
    }

    #[test]
    fn answer_defers_to_the_higher_node_and_retries_without_coordinator() {
        let mut node = BullyNode::new(0, 3, BullyConfig::default());
        node.start(at(0));
        drain(&mut node);
        node.handle_message(at(10), 2, Message::Answer);
        assert_eq!(node.role(), Role::AwaitingCoordinator { deadline: at(510) });
        // The winner never announces itself: start over.
        node.handle_timeout(at(510));
        assert_eq!(
            drain(&mut node),
            vec![send(1, Message::Election), send(2, Message::Election)]
        );
    }

    #[test]
    fn election_from_below_is_answered_and_taken_over() {
        let mut node = BullyNode::new(1, 3, BullyConfig::default());
        node.handle_message(at(0), 2, Message::Coordinator { epoch: 4 });
        assert_eq!(drain(&mut node), vec![]);
        node.handle_message(at(5), 0, Message::Election);
        assert_eq!(
            drain(&mut node),
            vec![send(0, Message::Answer), send(2, Message::Election)]
        );
        // A leader answers and reminds the asker who leads.
        let mut leader = BullyNode::new(2, 3, BullyConfig::default());
        leader.start(at(0));
        drain(&mut leader);
        leader.handle_message(at(5), 0, Message::Election);
        assert_eq!(
            drain(&mut leader),
            vec![
                send(0, Message::Answer),
                send(0, Message::Coordinator { epoch: 1 })
            ]
        );
    }

    #[test]
    fn silence_from_the_coordinator_starts_an_election_with_a_higher_epoch() {
        let mut node = BullyNode::new(1, 3, BullyConfig::default());
        node.handle_message(at(0), 2, Message::Coordinator { epoch: 4 });
        node.handle_message(at(100), 2, Message::Heartbeat { epoch: 4 });
        assert_eq!(node.poll_timeout(), Some(at(850)));
        node.handle_timeout(at(850));
        assert_eq!(drain(&mut node), vec![send(2, Message::Election)]);
        node.handle_timeout(at(1050));
        assert_eq!(
            drain(&mut node),
            vec![
                Action::BecameLeader { epoch: 5 },
                send(0, Message::Coordinator { epoch: 5 }),
                send(2, Message::Coordinator { epoch: 5 }),
            ]
        );
        assert_eq!(node.leader_epoch(), Some(5));
    }

    #[test]
    fn a_higher_coordinator_deposes_and_a_lower_one_is_bullied() {
        let mut node = BullyNode::new(1, 3, BullyConfig::default());
        node.handle_timeout(at(750));
        node.handle_timeout(at(950));
        drain(&mut node);
        assert_eq!(node.leader_epoch(), Some(1));
        node.handle_message(at(960), 0, Message::Heartbeat { epoch: 1 });
        assert_eq!(
            drain(&mut node),
            vec![send(0, Message::Coordinator { epoch: 1 })]
        );
        node.handle_message(at(970), 2, Message::Heartbeat { epoch: 3 });
        assert_eq!(drain(&mut node), vec![Action::SteppedDown]);
        assert_eq!(node.epoch(), 3);
        assert_eq!(
            node.role(),
            Role::Follower {
                leader: Some(2),
                last_heard: at(970)
            }
        );
        // A follower that hears a lower coordinator bullies it.
        node.handle_message(at(980), 0, Message::Coordinator { epoch: 7 });
        assert_eq!(drain(&mut node), vec![send(2, Message::Election)]);
    }
}

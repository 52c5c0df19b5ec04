//! The four election algorithms as sans-IO state machines, and the trait the simulator drives.
//!
//! Each model has its own inherent API in the house style (`handle_*` inputs taking `now`,
//! commands, `poll_action` / `poll_timeout` outputs, one closed `Action` enum) and is unit-tested
//! on that API with exact actions. [`Process`] is the thin common face the simulator uses so
//! that all four run under identical fault schedules.
//!
//! Randomness never comes from inside a model. Every input carries `entropy`, a fresh random
//! `u64` drawn by the caller from its seeded generator; models that need randomness (Raft's
//! election timeouts) derive it from that, the others ignore it.

use std::fmt;

use baton_core::Instant;

/// The simulator face of a textbook model (bully, ring), whose module has a node type with
/// `new(id, nodes, config)`, `start`, `handle_message`, `handle_timeout`, `poll_action`,
/// `poll_timeout` and `leader_epoch`, an `Action` enum (`Send`, `BecameLeader`, `SteppedDown`)
/// and a `Message` enum with a `Heartbeat`: it needs no entropy, persists nothing, leads
/// until told otherwise (the epoch is its token), and its heartbeats are not election traffic.
macro_rules! textbook_model {
    ($(#[$doc:meta])* $algorithm:ident, $node:ident, $config:ident) => {
        $(#[$doc])*
        #[derive(Debug, Clone, Copy, Default)]
        pub struct $algorithm {
            /// Timing shared by every node.
            pub config: $config,
        }

        impl super::Algorithm for $algorithm {
            type Process = $node;

            fn node(&self, id: NodeId, nodes: usize, _stable: Option<&()>) -> $node {
                $node::new(id, nodes, self.config)
            }
        }

        impl Process for $node {
            type Message = Message;
            type Stable = ();

            fn start(&mut self, now: Instant, _entropy: u64) {
                $node::start(self, now);
            }

            fn handle_message(&mut self, now: Instant, _entropy: u64, from: NodeId, message: Message) {
                $node::handle_message(self, now, from, message);
            }

            fn handle_timeout(&mut self, now: Instant, _entropy: u64) {
                $node::handle_timeout(self, now);
            }

            fn poll_output(&mut self) -> Option<Output<Message, ()>> {
                loop {
                    match self.poll_action()? {
                        Action::Send { to, message } => return Some(Output::Send { to, message }),
                        Action::BecameLeader { .. } | Action::SteppedDown => {}
                    }
                }
            }

            fn poll_timeout(&self) -> Option<Instant> {
                $node::poll_timeout(self)
            }

            fn leadership(&self, _now: Instant) -> Option<Leadership> {
                self.leader_epoch()
                    .map(|token| Leadership { token, until: None })
            }

            fn is_election_traffic(message: &Message) -> bool {
                !matches!(message, Message::Heartbeat { .. })
            }
        }
    };
}

pub mod bully;
pub mod lease;
pub mod raft;
pub mod ring;

/// A node's index, `0..nodes`. Infrastructure endpoints (the lease recipe's coordination
/// service) use indices from `nodes` upwards.
pub type NodeId = usize;

/// The most nodes a model supports: membership sets are `u32` bit masks.
pub const MAX_NODES: usize = 32;

/// What a node believes about its own leadership.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Leadership {
    /// The fencing token this node attaches to its writes while leading: the election epoch
    /// (bully, ring), the term (Raft) or the leader key's revision (lease).
    pub token: u64,
    /// A local-clock instant at which the node will stop acting on its own, if it has one
    /// (the lease recipe's local deadline). `None`: it acts until told otherwise.
    pub until: Option<Instant>,
}

/// What a [`Process`] asks the simulator to do.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Output<M, S> {
    /// Send `message` to endpoint `to`.
    Send {
        /// The destination endpoint.
        to: NodeId,
        /// The message.
        message: M,
    },
    /// Write this state to stable storage before anything that follows is sent. The
    /// simulator keeps it across a crash and hands it back on restart.
    Persist(S),
}

/// The common face of every model (and of infrastructure such as the coordination service).
///
/// Call order: [`Process::start`] once; then any interleaving of
/// [`Process::handle_message`] and [`Process::handle_timeout`] (the latter when
/// [`Process::poll_timeout`] has passed), draining [`Process::poll_output`] after each call.
pub trait Process {
    /// The protocol's messages.
    type Message: Copy + fmt::Debug;
    /// What survives a crash.
    type Stable: Clone + fmt::Debug;

    /// Boots the process.
    fn start(&mut self, now: Instant, entropy: u64);
    /// A message arrived from endpoint `from`.
    fn handle_message(&mut self, now: Instant, entropy: u64, from: NodeId, message: Self::Message);
    /// The instant returned by [`Process::poll_timeout`] has passed.
    fn handle_timeout(&mut self, now: Instant, entropy: u64);
    /// The next output, if any.
    fn poll_output(&mut self) -> Option<Output<Self::Message, Self::Stable>>;
    /// When [`Process::handle_timeout`] is next due, on this process's own clock.
    fn poll_timeout(&self) -> Option<Instant>;
    /// Whether this process acts as leader at `now`, and with which token.
    fn leadership(&self, now: Instant) -> Option<Leadership>;
    /// Whether `message` is election traffic (as opposed to heartbeats or lease renewals);
    /// the checker divides this traffic by the number of elections.
    fn is_election_traffic(message: &Self::Message) -> bool;
}

/// A factory for one algorithm's processes, so the simulator can boot and restart them.
pub trait Algorithm {
    /// The process type (node and infrastructure alike).
    type Process: Process;

    /// A node booting fresh, or restarting with what it persisted before crashing.
    fn node(
        &self,
        id: NodeId,
        nodes: usize,
        stable: Option<&<Self::Process as Process>::Stable>,
    ) -> Self::Process;

    /// Always-correct infrastructure endpoints, numbered from `nodes` upwards (never crash,
    /// never pause, run on the reference clock; partitions still cut them off). None by
    /// default: in bully, ring and Raft every endpoint is a node.
    fn infrastructure(&self, _nodes: usize) -> Vec<Self::Process> {
        Vec::new()
    }
}

/// The members of a `u32` bit mask, lowest first.
pub(crate) fn members(mask: u32) -> impl Iterator<Item = NodeId> {
    (0..MAX_NODES).filter(move |&i| mask & (1 << i) != 0)
}

/// The highest member of a non-empty bit mask.
pub(crate) fn highest_member(mask: u32) -> Option<NodeId> {
    (mask != 0).then(|| 31 - mask.leading_zeros() as usize)
}
